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

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# One torch (OpenMP) thread per process, set before anything imports torch; every program a test starts
# inherits it. The suite runs two workers on two cores, and most e2e tests run several training processes at
# once (SuperNodes' ClientApps, agents, torchrun ranks): with torch's default of a thread per core, each small
# step spin-waits for threads the others hold. Measured with the other core busy: a 2NN's step on a batch of 32
# took 1.95 ms of CPU (1.51 ms wall) on two threads, 0.40 ms on one (docs/testing.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Bytecode is written, whatever the caller's environment says (this machine sets PYTHONDONTWRITEBYTECODE=1; the
# Makefile unexports it, a bare `pytest` would not): the setup compiles nothing ahead, so without .pyc files every
# process the e2e tier starts compiled torch, Flower and the rest from source again, and the tier took 16 min 26 s
# instead of 8 min 33 s (the same tests, the same machine).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

from scenarios.schema import Scenario, scenario_from_dict  # noqa: E402 (after the environment above)

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


# --------------------------------------------------------------------------- the tier guard
#
# Installed once per session, it records into the test being run whatever starts a program or listens on
# a socket, through any phase: a module- or session-scoped fixture is set up inside the setup of the
# first test that needs it, so it is charged to that test. Python sockets are seen as they listen;
# sockets opened in C (uvloop under uvicorn) are seen by asking the OS which listening sockets this
# process holds after each phase.

_charged: list[list[str]] = []  # the running test's record (empty outside a test)


def _record(event: str) -> None:
    if _charged:
        _charged[-1].append(event[:200])


def _listening() -> set[tuple[str, int]]:
    import psutil

    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def pytest_configure() -> None:
    _build_font_cache()
    popen_init, listen = subprocess.Popen.__init__, socket.socket.listen

    def recording_popen(self: subprocess.Popen[bytes], args: Any, *rest: Any, **kwargs: Any) -> None:
        _record(f"a process: {args if isinstance(args, str) else ' '.join(map(str, args))}")
        popen_init(self, args, *rest, **kwargs)

    def recording_listen(self: socket.socket, *rest: Any) -> None:
        _record(f"a listening socket on {self.getsockname()}")
        listen(self, *rest)

    subprocess.Popen.__init__ = recording_popen  # type: ignore[method-assign]
    socket.socket.listen = recording_listen  # type: ignore[method-assign]


def _build_font_cache() -> None:
    """Let matplotlib build its font cache now, before the guard is installed and outside any test.

    On its first use in a fresh home (a new CI machine) matplotlib runs ``fc-list`` to list the system's fonts:
    inside a fast-tier test that draws a chart, the guard would fail the test for starting a program.
    """
    import matplotlib.font_manager  # noqa: F401 (imported for the cache it writes)


def _guarded(item: pytest.Item) -> bool:
    return item.get_closest_marker("e2e") is None


@contextlib.contextmanager
def _charging(item: pytest.Item) -> Iterator[None]:
    """Record into ``item`` what the phase inside starts, and the sockets still listening after it."""
    events = item.stash.setdefault(_EVENTS, [])
    before = item.stash.setdefault(_BEFORE, _listening())
    _charged.append(events)
    try:
        yield
    finally:
        _charged.pop()
        events.extend(f"a listening socket on {a}" for a in sorted(_listening() - before))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    if not _guarded(item):
        return (yield)
    with _charging(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    if not _guarded(item):
        return (yield)
    with _charging(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    result = yield
    events = item.stash.get(_EVENTS, [])
    if _guarded(item) and events:
        unique = list(dict.fromkeys(events))
        pytest.fail(f"{item.nodeid} is in the fast tier but started {unique[0]}"
                    f"{f' (and {len(unique) - 1} more)' if len(unique) > 1 else ''}: mark it "
                    "pytest.mark.e2e, or its module if a shared fixture did it (docs/testing.md)", pytrace=False)
    return result


_EVENTS = pytest.StashKey[list[str]]()
_BEFORE = pytest.StashKey[set[tuple[str, int]]]()


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs.db'}"
