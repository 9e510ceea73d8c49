"""The scenario as a run records it: only the sections the run used, the task's own options in full.

What a run stores (the run store's ``scenario``, an export's manifest) is read
back by people (the dashboard, ``quorum runs``) and by Quorum (resume compares
it with the scenario it is given). A section the run never read would describe
it wrongly: a survival task is not "``dataset = "mnist"``, ``model = "cnn"``",
the defaults of the built-in classifier it never ran, and a Flower app brings
its own model and data. So the record leaves out:

- ``[data]`` and ``[model]`` unless the task is the built-in classifier (or a
  subclass: it reads both), or the user set them (kept, so that nothing they
  wrote is lost);
- ``[data]``, ``[model]`` and ``[task]`` for a Flower app's own model (the
  app's ServerApp or first reply gave it; ``run.info["model"]`` says which);
- the optional features (``[faults]``, ``[secagg]``, ``[dp]``, ``[async]``,
  ``[compression]``) while they are off, that is at their defaults.

Reading a record back (``scenarios.schema.scenario_from_dict``) gives every
left-out section its defaults: the same scenario, whose record is the same
(for a run of a task; a Flower app's record reads back with Quorum's default
task, which its run never used, and such a run cannot be resumed).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from learning.task import Task
from learning.tasks.classification import ClassificationTask
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, build_options

__all__ = ["scenario_record", "task_options", "OPTIONAL_SECTIONS"]

#: Scenario fields that are off at their defaults: left out of a record while off.
OPTIONAL_SECTIONS = ("faults", "secagg", "dp", "asynchronous", "compression", "hierarchy")


def scenario_record(scenario: Scenario, task: Task | None) -> dict[str, Any]:
    """``scenario`` as a run records it, for a run of ``task`` (``None``: a Flower app's own model)."""
    record = scenario.to_dict()
    if task is None:  # the app's own model and data: nothing of Quorum's task ran
        for field in ("data", "model", "task"):
            record.pop(field)
    elif not isinstance(task, ClassificationTask):
        for field in ("data", "model"):
            if getattr(scenario, field) == type(getattr(scenario, field))():
                record.pop(field)
    for field in OPTIONAL_SECTIONS:
        if getattr(scenario, field) == type(getattr(scenario, field))():
            record.pop(Scenario.TOML_KEYS.get(field, field), None)
    if task is not None and "task" in record:
        record["task"] = {**record["task"], "options": task_options(task, scenario.task.options)}
    return record


def task_options(task: Task, given: Mapping[str, Any]) -> dict[str, Any]:
    """Return the task's options in full (its ``Options`` with every default), as JSON values; else those given.

    The full form is kept only when it reads back as the same options: every
    value plain JSON (no infinity or NaN, which JSON cannot hold), and the
    task's own ``Options`` accepting it (a default of a type its keys do not
    take, a tuple, would not), so a stored run can always be read again.
    """
    options = getattr(task, "options", None)
    if not dataclasses.is_dataclass(options) or isinstance(options, type):
        return dict(given)
    try:
        full: dict[str, Any] = json.loads(json.dumps(dataclasses.asdict(options), allow_nan=False))
        if build_options(type(options), full, "record") != options:
            return dict(given)
    except (TypeError, ValueError, ScenarioError):
        return dict(given)
    return full
