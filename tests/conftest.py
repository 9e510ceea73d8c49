"""Shared factories for the test suite, and the guard that keeps its two tiers honest.

The suite has two tiers (docs/testing.md): the unit and in-process tier, and the
``e2e`` tier (tests marked ``pytest.mark.e2e``: real processes, sockets, a browser).
A test outside the e2e tier that starts a real process (``subprocess.Popen``,
which ``subprocess.run``, torchrun, Ray and the ``quorum`` CLI all go through) or
listens on a socket fails, naming what it started: ``make test-fast`` stays fast
because nothing slow can hide in it. The in-process runtime's forked worker pool
is part of the first tier (it starts no new program).
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from scenarios.schema import Scenario, scenario_from_dict

REPO = Path(__file__).resolve().parents[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str | Callable[[], str],
             poll_s: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that value.

    The one way a test waits: it never returns on a timeout, it fails naming
    ``what`` (a string, or a callable asked only then, e.g. for process logs).
    The predicate is asked once more at the deadline, so a slow poll cannot
    make a condition that did come true look like a timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    detail = what() if callable(what) else what
    pytest.fail(f"timed out after {timeout:g} s waiting for {detail}")


def tiny_scenario(**sections: Any) -> Scenario:
    """A federation that runs in about a second: sklearn digits, logistic regression."""
    raw: dict[str, Any] = {
        "name": "tiny", "seed": 3, "rounds": 2,
        "data": {"dataset": "digits", "partition": "iid", "server_test_fraction": 0.2},
        "model": {"name": "logreg"},
        "federation": {"clients": 4, "fraction": 1.0, "min_clients": 1, "deadline_s": 20.0},
        "training": {"local_epochs": 1, "batch_size": 16, "lr": 0.1},
    }
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and key in raw else value
    return scenario_from_dict(raw, source="tiny")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heavy tests first (a stable sort): the workers then end together, instead of one of them
    starting a long test when the other is done."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail a test outside the e2e tier that starts a program or listens on a socket."""
    if request.node.get_closest_marker("e2e") is not None:
        yield
        return
    started: list[str] = []
    popen_init, listen = subprocess.Popen.__init__, socket.socket.listen

    def recording_popen(self: subprocess.Popen[bytes], args: Any, *rest: Any, **kwargs: Any) -> None:
        started.append(f"a process: {args if isinstance(args, str) else ' '.join(map(str, args))}"[:200])
        popen_init(self, args, *rest, **kwargs)

    def recording_listen(self: socket.socket, *rest: Any) -> None:
        started.append(f"a listening socket on {self.getsockname()}")
        listen(self, *rest)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_popen)
    monkeypatch.setattr(socket.socket, "listen", recording_listen)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} is in the fast tier but started {started[0]}"
                    f"{f' (and {len(started) - 1} more)' if len(started) > 1 else ''}: mark it "
                    "pytest.mark.e2e (docs/testing.md)", pytrace=False)


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs.db'}"
