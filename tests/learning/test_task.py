"""The task interface: what travels, how a scenario names a task, how its keys are checked, the built-ins."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from core.instructions import TrainConfig
from learning.errors import TaskError
from learning.federation import cached_federation
from learning.models import build_model, get_flat, get_trainable_flat, num_trainable, set_trainable_flat
from learning.task import Split, Task, TaskModel, check_metrics, load_task
from learning.tasks.regression import RegressionData, RegressionTask, regression_metrics
from runtimes.parallel.errors import ParallelError
from runtimes.parallel.job import check_scenario
from runtimes.parallel.mode import Mode
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, load_scenario, loads_scenario, scenario_from_dict
from tests.conftest import tiny_scenario

REGRESSION = "learning.tasks.regression:RegressionTask"


class FrozenFeatures(Task):
    """A pretrained-style model: a frozen Linear(4, 3) feature layer under a trainable Linear(3, 2) head."""

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        model[0].requires_grad_(False)
        return model

    def partition(self, partition_id: int) -> Split:  # noqa: ARG002 (Task's signature)
        x = torch.ones(6, 4)
        return Split((x, torch.zeros(6, dtype=torch.long)), (x, torch.zeros(6, dtype=torch.long)))

    def train(self, model: nn.Module, data: Any, config: TrainConfig, seed: int) -> dict[str, float]:  # noqa: ARG002
        x, y = data
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=config.lr)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return {"loss": loss.item(), "num_examples": len(y)}

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:  # noqa: ARG002 (Task's signature)
        return {"loss": 0.5, "num_examples": len(data[1])}


def test_frozen_layers_never_travel() -> None:
    # Prepare: head Linear(3, 2) has 3*2 + 2 = 8 trainable values; the frozen Linear(4, 3) has 15
    tm = TaskModel.build(FrozenFeatures(None, tiny_scenario()), seed=0)
    frozen_before = tm.model[0].weight.detach().clone()

    # Execute
    flat = tm.get_flat()
    tm.set_flat(np.arange(8, dtype=np.float32))
    tm.train(tm.task.partition(0).train, TrainConfig(round=1, epochs=1, batch_size=6, lr=0.1, seed=0), seed=1)

    # Assert
    assert tm.names == ("2.weight", "2.bias")
    assert flat.size == 8 == num_trainable(tm.model) and get_flat(tm.model).size == 8 + 15
    assert torch.equal(tm.model[0].weight, frozen_before)  # neither loading nor training touched it
    assert tm.get_flat().size == 8


def test_trainable_flat_round_trips_and_checks_its_size() -> None:
    # Prepare
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[1].requires_grad_(False)
    values = np.array([1, 2, 3, 4, 5, 6], dtype=np.float32)  # 2*2 weights + 2 biases

    # Execute
    set_trainable_flat(model, values)

    # Assert
    assert np.array_equal(get_trainable_flat(model), values)
    assert model[0].weight.tolist() == [[1, 2], [3, 4]] and model[0].bias.tolist() == [5, 6]
    with pytest.raises(ValueError, match="expected 6 trainable values"):
        set_trainable_flat(model, np.zeros(9, dtype=np.float32))


def test_a_scenario_without_a_task_gets_the_built_in_classification_bit_for_bit() -> None:
    # Prepare
    scenario = tiny_scenario()
    fed = cached_federation(scenario)
    expected = get_flat(build_model("logreg", fed.input_shape, fed.num_classes, seed=scenario.seed))

    # Execute
    task = load_task(scenario)
    tm = TaskModel.build(task, scenario.seed)

    # Assert: the whole state_dict travels, as before tasks existed; data are the federation's
    assert type(task).__name__ == "ClassificationTask"
    assert np.array_equal(tm.get_flat(), expected)
    assert task.partition(2) is fed.clients[2] and task.server_data() is fed.test
    assert load_task(scenario) is task  # built once per scenario


def test_regression_metrics_by_hand() -> None:
    # pred - y = (0, -1, 3): MAE 4/3, MSE 10/3; mean(y) = 5/3, SS_tot = 4/9 + 16/9 + 4/9 = 8/3,
    # R^2 = 1 - 10 / (8/3) = -2.75
    m = regression_metrics(np.array([1.0, 2.0, 4.0]), np.array([1.0, 3.0, 1.0]))
    assert m["mae"] == pytest.approx(4 / 3) and m["loss"] == pytest.approx(10 / 3)
    assert m["rmse"] == pytest.approx(math.sqrt(10 / 3)) and m["r2"] == pytest.approx(-2.75)
    assert m["num_examples"] == 3


def test_regression_task_evaluates_a_known_model_in_target_units() -> None:
    # Prepare: y_hat = x0 gives predictions (1, 2, 4) against targets (1, 3, 1); scale 2 doubles MAE and RMSE
    task = RegressionTask(RegressionTask.Options(), tiny_scenario())
    model = nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0]]))
        model.bias.zero_()
    data = RegressionData(np.array([[1, 9], [2, 9], [4, 9]], dtype=np.float32),
                          np.array([1, 3, 1], dtype=np.float32), scale=2.0)

    # Execute
    m = task.evaluate(model, data)

    # Assert
    assert m["mae"] == pytest.approx(8 / 3) and m["rmse"] == pytest.approx(2 * math.sqrt(10 / 3))
    assert m["loss"] == pytest.approx(10 / 3) and m["r2"] == pytest.approx(-2.75)


def test_regression_task_trains_down_its_loss() -> None:
    # Prepare
    scenario = scenario_from_dict({"name": "r", "seed": 1, "federation": {"clients": 4}, "task": {"entry": REGRESSION}})
    task = load_task(scenario)
    tm = TaskModel.build(task, scenario.seed)
    data = task.partition(0)
    config = TrainConfig(round=1, epochs=5, batch_size=16, lr=0.05, seed=1)
    before = tm.evaluate(data.train)["loss"]

    # Execute
    for round_ in range(3):
        result = tm.train(data.train, config, seed=round_)

    # Assert: 442 patients, 20% held out (88), the rest dealt over 4 clients (88 or 89), 90% of that to train
    assert len(task.server_data()) == 88 and len(data.train) + len(data.test) in (88, 89)
    assert result["num_examples"] == len(data.train)
    assert tm.evaluate(data.train)["loss"] < before


def test_task_keys_are_checked_naming_file_key_and_value() -> None:
    # Prepare
    def scenario(extra: str) -> Scenario:
        return loads_scenario(f'name = "r"\n[task]\nentry = "{REGRESSION}"\n{extra}\n', source="reg.toml")

    # Execute / Assert
    with pytest.raises(ScenarioError, match=r"^reg\.toml: task\.hiden = 8: unknown key; allowed: .*hidden"):
        load_task(scenario("hiden = 8"))
    with pytest.raises(ScenarioError, match=r"^reg\.toml: task\.hidden = 0: must be in \[1, 65,536\]"):
        load_task(scenario("hidden = 0"))
    with pytest.raises(ScenarioError, match=r"^reg\.toml: task\.dataset = 'boston': must be one of"):
        load_task(scenario('dataset = "boston"'))
    with pytest.raises(ScenarioError, match=r"^reg\.toml: task\.hidden = '8': must be an integer"):
        load_task(scenario('hidden = "8"'))
    assert load_task(scenario("hidden = 8")).options.hidden == 8


def test_a_bad_entry_is_named() -> None:
    with pytest.raises(ScenarioError, match=r"task\.entry = 'no_such_module_q:Task': cannot import"):
        load_task(loads_scenario('[task]\nentry = "no_such_module_q:Task"\n', source="s.toml"))
    with pytest.raises(ScenarioError, match=r"module 'learning\.task' has no class 'Nope'"):
        load_task(loads_scenario('[task]\nentry = "learning.task:Nope"\n', source="s.toml"))
    with pytest.raises(ScenarioError, match=r"task\.entry = 'not an entry'"):
        loads_scenario('[task]\nentry = "not an entry"\n', source="s.toml")


def test_entry_resolves_in_the_scenario_folder_and_survives_the_run_config(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a task module beside the scenario, loaded from another working directory
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "q_local_task.py").write_text(
        "from tests.learning.test_task import FrozenFeatures\n\nclass Mine(FrozenFeatures):\n    pass\n")
    (tmp_path / "proj" / "scenario.toml").write_text('name = "p"\n[task]\nentry = "q_local_task:Mine"\n')
    monkeypatch.chdir(tmp_path)

    # Execute
    scenario = load_scenario(tmp_path / "proj" / "scenario.toml")
    travelled = scenario_from_dict(scenario.to_dict(), source="run_config")

    # Assert
    assert scenario.task.path == str((tmp_path / "proj").resolve())
    assert type(load_task(travelled)).__name__ == "Mine"
    assert TaskModel.build(load_task(travelled), 0).get_flat().size == 8


def test_metrics_must_include_loss_and_count() -> None:
    task = FrozenFeatures(None, tiny_scenario())
    with pytest.raises(TaskError, match=r"FrozenFeatures\.train must report 'num_examples'"):
        check_metrics({"loss": 1.0}, "train", task)
    with pytest.raises(TaskError, match=r"metric 'mae' = nan is not a finite number"):
        check_metrics({"loss": 1.0, "num_examples": 3, "mae": float("nan")}, "evaluate", task)


def test_the_parallel_mode_refuses_a_task_of_ones_own() -> None:
    scenario = scenario_from_dict({"name": "r", "task": {"entry": REGRESSION}})
    with pytest.raises(ParallelError, match=r"task\.entry = 'learning\.tasks\.regression:RegressionTask'"):
        check_scenario(scenario, Mode.SYNC, 2)
