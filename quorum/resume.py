"""``quorum resume``: what it continues, checked before anything runs or is written.

``quorum resume RUN [SCENARIO]`` continues a run whose process died (it reads
``interrupted``) from its last committed round, with the run's own scenario:
a scenario file that differs is refused, naming what differs. A run that
already ended is left untouched. ``quorum resume --from RUN --round N
[SCENARIO]`` starts a new run from round N of RUN instead (its parent,
recorded in the new run's ``info["parent"]``), with the run's scenario or the
one given.

Either way this process takes the run it will drive before anything is
printed or written (``runstore.takeover``): a run another live process drives
is refused (:class:`~runstore.takeover.RunHeld`), and the plan names the
holder the run was taken for, which the driver writes as.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from aggregator.resume import has_ended, take_to_resume
from aggregator.serverapp import fork_run
from runstore.store import Run
from runstore.takeover import TakenRunStore
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
    holder: str | None = None  # who took the run to drive it (runstore.takeover); None: an ended run, not taken


def _scenario(run: Run, path: Path | None) -> Scenario:
    return load_scenario(path) if path is not None else scenario_from_dict(run.scenario, source=f"run {run.id}")


def _engine(run: Run) -> str:
    return "ray" if run.engine == "ray" else "inprocess"


def _when(ts: float | None) -> str:
    return "an unknown time" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def plan_resume(store: TakenRunStore, run_id: str, path: Path | None = None) -> Plan:
    """Plan to continue ``run_id``, taking it for ``store``; a run that ended is only reported.

    Refused (:class:`~aggregator.errors.ResumeRefused`) for another scenario than the run's;
    refused (:class:`~runstore.takeover.RunHeld`), nothing written, while
    another live process drives it.
    """
    run = store.get_run(run_id)
    scenario = _scenario(run, path)
    take_to_resume(store, run.id, scenario)
    if has_ended(run):
        return Plan(run.id, scenario, run.engine, run.rounds_done, ended=True,
                    note=f"run {run.id} already ended ({run.status}, {run.rounds_done}/{run.rounds_total} rounds, "
                         f"at {_when(run.finished_at)}): nothing to resume, the run is left as it was")
    return Plan(run.id, scenario, _engine(run), run.rounds_done, holder=store.holder)


def plan_fork(store: TakenRunStore, parent_id: str, server_round: int | None, path: Path | None = None) -> Plan:
    """Plan a new run from round ``server_round`` (default: the last) of ``parent_id``, taken for ``store``.

    It runs the parent's scenario or the one at ``path``; the parent is left as
    it was.
    """
    parent = store.get_run(parent_id)
    scenario = _scenario(parent, path)
    child = fork_run(store, parent.id, server_round, scenario, _engine(parent))
    store.take(child)  # a new run, that no other process knows of yet
    start = store.get_run(child).rounds_done
    return Plan(child, scenario, _engine(parent), start, holder=store.holder,
                note=f"new run {child} from round {start} of run {parent.id}")
