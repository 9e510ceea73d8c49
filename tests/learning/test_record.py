"""What a run records of its scenario (``learning.record``): only the sections it used, the task's options in full."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import ClassVar

import pytest

from aggregator.errors import ResumeRefused
from aggregator.resume import check_same_scenario
from learning.record import scenario_record
from learning.task import load_task
from runstore.store import Run
from scenarios.schema import Scenario, scenario_from_dict
from tests.conftest import tiny_scenario
from tests.learning.survival_task import SurvivalTask

SURVIVAL = {"entry": "tests.learning.survival_task:SurvivalTask"}
ALWAYS = {"name", "seed", "rounds", "description", "federation", "training", "strategy", "evaluation"}


def record(scenario: Scenario) -> dict:
    return scenario_record(scenario, load_task(scenario))


def test_a_users_task_records_neither_the_builtin_data_nor_model_and_its_options_in_full() -> None:
    scenario = scenario_from_dict({"name": "survival", "task": SURVIVAL}, source="test")  # no task keys given

    recorded = record(scenario)

    # the built-in classifier's MNIST CNN, which never ran, is not described; nor the features that were off
    assert set(recorded) == ALWAYS | {"task"}
    # SurvivalOptions' default (steps = 10), written out though the scenario gave none
    assert recorded["task"]["options"] == {"steps": 10}
    assert recorded["task"]["entry"] == SURVIVAL["entry"]


def test_the_builtin_classifier_records_its_data_and_model() -> None:
    recorded = record(tiny_scenario())
    assert recorded["data"]["dataset"] == "digits" and recorded["model"]["name"] == "logreg"
    assert set(recorded) == ALWAYS | {"data", "model", "task"}


def test_data_a_user_wrote_for_a_task_is_kept() -> None:
    # [data] standardize = "federated" standardises a task's features: not a default, so it is recorded
    scenario = scenario_from_dict({"name": "r", "task": {"entry": "learning.tasks.regression:RegressionTask"},
                                   "data": {"standardize": "federated"}}, source="test")
    recorded = record(scenario)
    assert recorded["data"]["standardize"] == "federated" and "model" not in recorded


@pytest.mark.parametrize(("section", "table", "key"), [
    ("secagg", {"enabled": True}, "secagg"),
    ("dp", {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 1.0}, "dp"),
    ("faults", {"stragglers": 0.25}, "faults"),
    ("compression", {"downlink_bits": 16}, "compression"),
])
def test_a_feature_that_is_on_is_recorded_and_off_it_is_not(section: str, table: dict, key: str) -> None:
    assert key not in record(tiny_scenario())
    assert record(tiny_scenario(**{section: table}))[key] == {**tiny_scenario().to_dict()[key], **table}


def test_a_flower_apps_own_model_records_no_task_data_or_model() -> None:
    recorded = scenario_record(tiny_scenario(), None)
    assert set(recorded) == ALWAYS


@pytest.mark.parametrize("scenario", [
    tiny_scenario(), tiny_scenario(secagg={"enabled": True}),
    scenario_from_dict({"name": "survival", "task": {**SURVIVAL, "steps": 3}}, source="test"),
])
def test_a_record_reads_back_as_the_same_scenario(scenario: Scenario) -> None:
    recorded = record(scenario)
    again = scenario_from_dict(recorded, source="record")
    assert record(again) == recorded
    assert (again.rounds, again.federation, again.secagg, again.training) == (
        scenario.rounds, scenario.federation, scenario.secagg, scenario.training)


@dataclass(frozen=True)
class EdgeOptions:
    """Defaults JSON cannot hold (an infinity) or the schema does not read back (a tuple)."""

    clip: float = math.inf
    sizes: tuple = (1, 2)


class EdgeTask(SurvivalTask):
    Options: ClassVar[type] = EdgeOptions


def test_options_that_would_not_read_back_are_recorded_as_given() -> None:
    scenario = scenario_from_dict({"name": "edge", "task": {"entry": f"{__name__}:EdgeTask"}}, source="test")
    recorded = record(scenario)
    assert recorded["task"]["options"] == {}  # as given: the full form would not load again
    json.dumps(recorded, allow_nan=False)  # plain JSON: SQLite's json_extract reads every run's record
    assert record(scenario_from_dict(recorded, source="record")) == recorded


# -- resume compares scenarios read back in full --------------------------------------------------------------


def stored_run(scenario: Scenario, info: dict | None = None) -> Run:
    return Run(id="r1", scenario=json.loads(json.dumps(record(scenario))), info=info or {})


def test_resume_accepts_a_users_task_run_with_its_own_scenario_and_names_a_changed_option() -> None:
    scenario = scenario_from_dict({"name": "survival", "task": SURVIVAL}, source="test")
    check_same_scenario(stored_run(scenario), scenario)  # defaults left out of the scenario: the same

    changed = scenario_from_dict({"name": "survival", "task": {**SURVIVAL, "steps": 3}}, source="test")
    with pytest.raises(ResumeRefused, match=r"has another scenario: task\.options\.steps: 10 in the run, 3 in the "
                                            r"scenario; the run"):
        check_same_scenario(stored_run(scenario), changed)


def test_resume_names_only_the_key_that_turned_a_feature_on() -> None:
    # the run recorded no [secagg] (it was off); the scenario turns it on: one key differs, not the whole section
    with pytest.raises(ResumeRefused, match=r"has another scenario: secagg\.enabled: false in the run, true in the "
                                            r"scenario; the run"):
        check_same_scenario(stored_run(tiny_scenario()), tiny_scenario(secagg={"enabled": True}))


def test_a_flower_apps_run_is_not_resumed_with_quorums_default_task() -> None:
    run = stored_run(tiny_scenario(), info={"model": "app.server_app:app (the app's own ServerApp)"})
    with pytest.raises(ResumeRefused, match="trained a Flower app's own model .* cannot rebuild"):
        check_same_scenario(run, tiny_scenario())
