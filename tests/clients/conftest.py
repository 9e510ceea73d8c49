"""Fixtures of the ClientApp's tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a Message needs Flower's task identity (the runtimes set it)."""
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1, raising=False)
