"""Shared factories for the test suite."""

from __future__ import annotations

import time
from collections.abc import Callable
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


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs.db'}"
