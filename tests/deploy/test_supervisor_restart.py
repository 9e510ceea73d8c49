"""The aggregator's watch loop: restarts that back off and end on stop, resumes only by the leader."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest

from deploy import supervisor as sup_module
from deploy.config import load_config
from deploy.supervisor import ANSWER_S, STABLE_S, Supervisor, _Child


class _Waits:
    """Stands in for the supervisor's ``stopping`` event: records each back-off asked for, never waits."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.asked: list[float] = []
        self.stop_after = stop_after

    def wait(self, seconds: float) -> bool:
        self.asked.append(seconds)
        return self.stop_after is not None and len(self.asked) > self.stop_after

    def is_set(self) -> bool:
        return False

    def set(self) -> None:
        self.stop_after = 0


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(__import__("time"), name)


@pytest.fixture
def sup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Supervisor:
    path = tmp_path / "federation.toml"
    path.write_text('[aggregator]\nstate_dir = "st"\n')
    monkeypatch.setattr(Supervisor, "_write_pidfile", lambda _self: None)
    return Supervisor(load_config(path), say=lambda _m: None)


def _child(starts: list[float], clock: _Clock, monkeypatch: pytest.MonkeyPatch) -> _Child:
    def start(self: _Child) -> None:
        self.started_at = clock.now
        starts.append(clock.now)

    monkeypatch.setattr(_Child, "start", start)
    return _Child("dashboard", ["true"], {}, Path("dashboard.log"))


def test_a_crash_loop_backs_off_and_a_child_that_ran_a_while_restarts_at_once(
        sup: Supervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a child that exits again and again, then stays up for STABLE_S, then exits once more
    clock, starts = _Clock(), []
    monkeypatch.setattr(sup_module, "time", clock)
    waits = _Waits()
    sup.stopping = waits  # type: ignore[assignment]
    child = _child(starts, clock, monkeypatch)

    # Execute
    for _ in range(4):
        sup._restart(child)
        clock.now += 1.0
    clock.now += STABLE_S
    sup._restart(child)

    # Assert: 0, 1, 2, 3 s, then at once again (the count starts over); a start after each wait
    assert waits.asked == [0, 1, 2, 3, 0]
    assert child.restarts == 1 and len(starts) == 5


def test_stop_during_a_back_off_restarts_nothing(sup: Supervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    clock, starts = _Clock(), []
    monkeypatch.setattr(sup_module, "time", clock)
    sup.stopping = _Waits(stop_after=1)  # type: ignore[assignment]  # the second wait is cut by a stop
    child = _child(starts, clock, monkeypatch)

    sup._restart(child)
    sup._restart(child)

    assert starts == [1000.0]  # only the first restart started it


class _Lead:
    def __init__(self, alive: bool) -> None:
        self.is_alive = alive

    def alive(self) -> bool:
        return self.is_alive


@pytest.mark.parametrize("leads", [True, False], ids=["leads", "lost-the-lead"])
def test_a_restarted_superlinks_runs_are_resumed_only_by_the_aggregator_that_still_leads(
        sup: Supervisor, monkeypatch: pytest.MonkeyPatch, leads: bool) -> None:
    # Prepare: the SuperLink answers again; the lead was kept, or lost while it restarted
    done: list[str] = []
    monkeypatch.setattr(sup_module, "_get", lambda *_: 200)
    monkeypatch.setattr(sup_module, "stop_leftover_serverapps", lambda _root: done.append("serverapps") or [])
    monkeypatch.setattr(sup_module, "resumable_runs", lambda *_: [])
    monkeypatch.setattr(sup_module, "RunStore", lambda _url: contextlib.nullcontext())
    monkeypatch.setattr(Supervisor, "_stop_orphaned_runs", lambda _self: done.append("orphans"))
    monkeypatch.setattr(Supervisor, "resume_interrupted", lambda _self: done.append("resumed") or [])
    sup.leadership = _Lead(leads)  # type: ignore[assignment]
    sup.resume_pending = 1.0

    # Execute
    sup._resume_after_superlink()

    # Assert: no second driver of a run the standby resumes now
    assert sup.resume_pending is None
    assert done == (["serverapps", "orphans", "resumed"] if leads else [])


def test_a_restarted_superlink_that_does_not_answer_keeps_its_runs_pending_and_says_so_once(
        sup: Supervisor, monkeypatch: pytest.MonkeyPatch) -> None:
    clock, said = _Clock(), []
    monkeypatch.setattr(sup_module, "time", clock)
    monkeypatch.setattr(sup_module, "_get", lambda *_: 0)
    monkeypatch.setattr(Supervisor, "resume_interrupted", lambda _self: pytest.fail("resumed without a SuperLink"))
    sup.say = said.append
    sup.resume_pending = clock.now

    for step in (1.0, ANSWER_S, 1.0, 1.0):
        clock.now += step
        sup._resume_after_superlink()

    assert sup.resume_pending == 1000.0  # still waiting for it: the watch loop asks again
    assert len(said) == 1 and f"does not answer after {ANSWER_S:g} s" in said[0]
