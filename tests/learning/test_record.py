"""What a run records of its scenario (``learning.record``): only the sections it used, the task's options in full."""

from __future__ import annotations

import pytest

from learning.record import scenario_record
from learning.task import load_task
from scenarios.schema import Scenario, scenario_from_dict
from tests.conftest import tiny_scenario

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
