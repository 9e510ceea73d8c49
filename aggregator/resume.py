"""Resuming a run: what may continue it, and the state it continues from.

A run continues only with the scenario it was started with: another number of
rounds, another model or another seed would train new settings on the old run
(and another model's parameters do not even fit its checkpoint).
:func:`check_same_scenario` refuses that before anything is written, naming
what differs. A new run from one round of an old one (``quorum resume --from
RUN --round N``) records its parent in ``info["parent"]`` and starts from that
round's checkpoint (:func:`start_state`). A run that already ended is left as
it is (:func:`has_ended`). The process that continues a run takes it first
(:func:`take_to_resume`), in one conditional write: while another live
process drives the run, a resume is refused before it writes anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from aggregator.errors import ResumeRefused
from core.status import ENDED, RunStatus
from core.strategy import ServerState, Strategy, describe, initial_state
from runstore.store import Run, RunStore
from runstore.takeover import TakenRunStore
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, build_options, scenario_from_dict

__all__ = ["has_ended", "scenario_difference", "check_same_scenario", "take_to_resume", "parent_of", "start_state"]

#: Statuses of a run that ran to its end (``quorum resume`` leaves such a run untouched).
_SHOWN = 3  # differences named in one line


def has_ended(run: Run) -> bool:
    """Tell whether ``run`` ended: finished, degraded, out of privacy budget, or failed after its last round."""
    return run.status in ENDED or (run.status == RunStatus.FAILED and run.rounds_done >= run.rounds_total)


def _leaves(table: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in table.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


_ABSENT = object()


def _show(value: Any) -> str:
    return "absent" if value is _ABSENT else json.dumps(value, default=str)


def scenario_difference(run: Mapping[str, Any], scenario: Mapping[str, Any]) -> str | None:
    """Name the keys whose values differ, one line (``rounds: 3 in the run, 5 in the scenario``); ``None`` if none."""
    old, new = dict(_leaves(run)), dict(_leaves(scenario))
    keys = [k for k in old if old[k] != new.get(k, _ABSENT)] + [k for k in new if k not in old]
    shown = [f"{k}: {_show(old.get(k, _ABSENT))} in the run, {_show(new.get(k, _ABSENT))} in the scenario"
             for k in keys[:_SHOWN]]
    more = f" (and {len(keys) - _SHOWN} more)" if len(keys) > _SHOWN else ""
    return "; ".join(shown) + more if keys else None


def check_same_scenario(run: Run, scenario: Scenario) -> None:
    """Refuse to continue ``run`` with another scenario than its own.

    Raises
    ------
    ResumeRefused
        Naming what differs, and how to start a new run from the old one instead.
    """
    model = (run.info or {}).get("model")
    if model:
        raise ResumeRefused(f"run {run.id} trained a Flower app's own model ({model}), which Quorum cannot rebuild "
                            "from a scenario; the run is left as it was (run the app again: quorum flower run, or "
                            "flwr run)")
    stored = scenario_from_dict(run.scenario, source=f"run {run.id}")  # as today's schema reads it (and a record
    # leaves out what the run did not use: read back, those sections have their defaults again)
    diff = scenario_difference(_comparable(stored, f"run {run.id}"), _comparable(scenario, "the scenario"))
    if diff is not None:
        raise ResumeRefused(f"run {run.id} has another scenario: {diff}; the run is left as it was (to train "
                            f"these settings from one of its rounds: quorum resume --from {run.id} --round N "
                            "SCENARIO)")


def take_to_resume(store: TakenRunStore, run_id: str, scenario: Scenario) -> Run:
    """Check that ``scenario`` may continue run ``run_id`` and, unless the run ended, take it for ``store``.

    Returns the run as read before it was taken (an ended run is left as it
    is, untaken).

    Raises
    ------
    ResumeRefused
        Another scenario than the run's (:func:`check_same_scenario`).
    runstore.takeover.RunHeld
        A live process drives the run (:meth:`~runstore.takeover.TakenRunStore.claim`); nothing was written.
    """
    run = store.get_run(run_id)
    check_same_scenario(run, scenario)
    if not has_ended(run):
        store.claim(run.id)
    return run


def _comparable(scenario: Scenario, what: str) -> dict[str, Any]:
    """``scenario`` in full, its task's options with their defaults (a run records them so, ``learning.record``).

    Raises
    ------
    ResumeRefused
        The task's class cannot be imported, or its options do not validate.
    """
    from learning.task import NoOptions, task_class  # the task's module (and torch) only when a resume is checked

    raw = scenario.to_dict()
    spec = scenario.task
    try:
        options = build_options(getattr(task_class(spec), "Options", NoOptions), dict(spec.options), what)
    except ScenarioError as exc:
        raise ResumeRefused(f"{what}'s task cannot be loaded to compare: {exc}") from None
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        raw["task"] = {**raw["task"], "options": json.loads(json.dumps(dataclasses.asdict(options), default=repr))}
    return raw


def parent_of(run: Run) -> tuple[str, int] | None:
    """Return the run and round a run was started from (``quorum resume --from``), if any."""
    parent = (run.info or {}).get("parent")
    if not isinstance(parent, Mapping) or not isinstance(parent.get("round"), int):
        return None
    return str(parent.get("run")), int(parent["round"])


def start_state(store: RunStore, run: Run, strategy: Strategy[Any]) -> ServerState | None:
    """Return the state ``run`` continues from.

    Its last committed round, else its parent's round (with the optimiser and
    privacy state only when the strategy is the parent's), else ``None`` (a
    fresh start).
    """
    own = store.load_state(run.id)
    origin = parent_of(run)
    if own is not None or origin is None:
        return own
    parent_id, server_round = origin
    state = store.load_state(parent_id, server_round)
    if state is None or state.round != server_round:
        raise ResumeRefused(f"run {run.id} starts from round {server_round} of run {parent_id}, whose checkpoint "
                            "is gone from the store")
    if (store.get_run(parent_id).info or {}).get("strategy") == describe(strategy):
        return state
    return replace(initial_state(strategy, state.params), round=server_round)
