"""``quorum resume``: what it continues, checked before anything runs or is written.

``quorum resume RUN [SCENARIO]`` continues a run whose process died (it reads
``interrupted``) from its last committed round, with the run's own scenario:
a scenario file that differs is refused, naming what differs. A run that
already ended is left untouched. ``quorum resume --from RUN --round N
[SCENARIO]`` starts a new run from round N of RUN instead (its parent,
recorded in the new run's ``info["parent"]``), with the run's scenario or the
one given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from aggregator.errors import ResumeRefused
from aggregator.resume import check_same_scenario, has_ended
from aggregator.serverapp import fork_run
from core.status import RunStatus
from runstore.store import Run, RunStore
from scenarios.schema import Scenario, load_scenario, scenario_from_dict

__all__ = ["Plan", "plan_resume", "plan_fork"]


@dataclass(frozen=True)
class Plan:
    """The run ``quorum resume`` drives (or, ``ended``, only reports) and how."""

    run_id: str
    scenario: Scenario
    engine: str
    done: int  # rounds committed before this start
    ended: bool = False
    note: str | None = None  # a line to print before the run starts


def _scenario(run: Run, path: Path | None) -> Scenario:
    return load_scenario(path) if path is not None else scenario_from_dict(run.scenario, source=f"run {run.id}")


def _engine(run: Run) -> str:
    return "ray" if run.engine == "ray" else "inprocess"


def _when(ts: float | None) -> str:
    return "an unknown time" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def plan_resume(store: RunStore, run_id: str, path: Path | None = None) -> Plan:
    """Plan to continue ``run_id``; a run that ended is only reported.

    Refused (:class:`ResumeRefused`) for another scenario than the run's or
    while its process still holds the run's lease.
    """
    run = store.get_run(run_id)
    scenario = _scenario(run, path)
    check_same_scenario(run, scenario)
    if has_ended(run):
        return Plan(run.id, scenario, run.engine, run.rounds_done, ended=True,
                    note=f"run {run.id} already ended ({run.status}, {run.rounds_done}/{run.rounds_total} rounds, "
                         f"at {_when(run.finished_at)}): nothing to resume, the run is left as it was")
    if run.status == RunStatus.RUNNING and run.lease_until is not None:  # renewed (a run without a lease is older)
        now = store.clock()
        raise ResumeRefused(f"run {run.id} is running: its process renewed its lease "
                            f"{max(0.0, now - (run.heartbeat_at or now)):.0f} s ago; if that process is gone, "
                            f"the run reads interrupted within {max(0.0, run.lease_until - now):.0f} s and "
                            "resumes then")
    return Plan(run.id, scenario, _engine(run), run.rounds_done)


def plan_fork(store: RunStore, parent_id: str, server_round: int | None, path: Path | None = None) -> Plan:
    """Plan a new run from round ``server_round`` (default: the last) of ``parent_id``.

    It runs the parent's scenario or the one at ``path``; the parent is left as
    it was.
    """
    parent = store.get_run(parent_id)
    scenario = _scenario(parent, path)
    child = fork_run(store, parent.id, server_round, scenario, _engine(parent))
    start = store.get_run(child).rounds_done
    return Plan(child, scenario, _engine(parent), start,
                note=f"new run {child} from round {start} of run {parent.id}")
