"""``dataset = "file"`` without a path: the data live on the devices alone (issue 17, item 4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from core.instructions import TrainConfig
from learning.errors import DataError
from learning.task import TaskModel, load_task
from scenarios.errors import ScenarioError
from scenarios.schema import load_scenario, scenario_from_dict
from tests.conftest import REPO


def write_csv(path: Path, rows: int, features: int, classes: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, features)).round(3)
    y = rng.integers(0, classes, size=rows)
    header = ",".join(["label"] + [f"f{i}" for i in range(features)])
    path.write_text(header + "\n" + "\n".join(",".join([str(label), *map(str, row)]) for label, row in zip(y, x,
                                                                                                        strict=True)))
    return path


def test_the_devices_scenario_needs_no_data_on_the_aggregator(tmp_path: Path) -> None:
    scenario = load_scenario(REPO / "scenarios" / "devices.toml")
    task = load_task(scenario)
    model = TaskModel.build(task, scenario.seed)

    assert task.server_data() is None
    assert model.model(torch.zeros(2, 64)).shape == (2, 10)  # built from data.features and data.classes
    with pytest.raises(DataError, match="no simulated clients"):
        task.partition(0)
    own = task.device_data(str(write_csv(tmp_path / "local.csv", 50, 64, 10, seed=1)))
    assert len(own.train) == 40 and len(own.test) == 10    # client_test_fraction = 0.2
    before = model.evaluate(own.train)["loss"]
    model.train(own.train, TrainConfig(round=1, epochs=20, batch_size=8, lr=0.1, seed=1), seed=1)
    assert model.evaluate(own.train)["loss"] < before


def test_a_device_file_that_does_not_fit_the_scenario_is_named(tmp_path: Path) -> None:
    task = load_task(load_scenario(REPO / "scenarios" / "devices.toml"))
    with pytest.raises(DataError, match="30 feature columns besides the label; the scenario expects data.features"):
        task.device_data(str(write_csv(tmp_path / "narrow.csv", 20, 30, 10, seed=2)))
    with pytest.raises(DataError, match=r"labels run from 0 to 1[0-9]; the scenario expects 0 .. 9"):
        task.device_data(str(write_csv(tmp_path / "more.csv", 40, 64, 14, seed=3)))


@pytest.mark.parametrize(("header", "named"), [
    ("{features},notes", "column 'notes' is one too many; remove it from the file, or set data.features = 65"),
    ("id,{features}", "column 'id' is one too many; remove it from the file, or set data.features = 65"),
])
def test_an_extra_csv_column_is_named(tmp_path: Path, header: str, named: str) -> None:
    # Prepare: a devices.toml file (64 features) with one more column, at the end or as a leading id
    task = load_task(load_scenario(REPO / "scenarios" / "devices.toml"))
    wide = write_csv(tmp_path / "wide.csv", 20, 65, 10, seed=4)
    lines = wide.read_text().splitlines()
    features = ",".join(f"f{i}" for i in range(64))
    wide.write_text("\n".join([f"label,{header.format(features=features)}", *lines[1:]]) + "\n")
    # Execute / Assert
    with pytest.raises(DataError, match="65 feature columns besides the label; the scenario expects "
                       f"data.features = 64: {named}"):
        task.device_data(str(wide))


def test_without_a_path_features_and_classes_are_required() -> None:
    raw = {"name": "x", "data": {"dataset": "file", "features": 8}}
    with pytest.raises(ScenarioError, match="data.path = '': is required when dataset = 'file', unless data.features"):
        scenario_from_dict(raw)
    raw["data"]["classes"] = 3
    assert scenario_from_dict(raw).data.classes == 3


def test_a_devices_only_scenario_is_refused_by_simulate(tmp_path: Path) -> None:
    from runtimes.simulation import simulate
    with pytest.raises(ScenarioError, match="deployed .*not simulated"):
        simulate(load_scenario(REPO / "scenarios" / "devices.toml"), db_url=f"sqlite:///{tmp_path / 'r.db'}")
