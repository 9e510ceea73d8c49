"""Exports are self-contained (issue 33, item 4): the task's source travels with the export, so
``quorum.load_model`` and ``quorum serve`` work after the project folder is gone."""

from __future__ import annotations

import json
import shutil
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from typer.testing import CliRunner

import quorum
from learning.datasets import load_digits
from quorum.errors import ExportError
from quorum.export import MANIFEST, example_shape, export_run, load_export
from quorum.serve import create_app
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.schema import scenario_from_dict

with warnings.catch_warnings():  # starlette's import-time deprecation (httpx2), not ours
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

LINEAR_TASK = '''
import torch
from torch.nn import functional as F

from helpers import linear_model
from learning.task import Split, Task


class LinearTask(Task):
    """y = the sum of a 2x3 grid of values; its data are (x, y) tuples, its features named."""

    feature_names = ("a1", "a2", "a3", "b1", "b2", "b3")

    def build_model(self, seed):
        return linear_model(seed)  # from a sibling module of the project

    def _data(self, n, seed):
        x = torch.randn(n, 2, 3, generator=torch.Generator().manual_seed(seed))
        return x, x.sum(dim=(1, 2)).unsqueeze(1)

    def server_data(self):
        return self._data(64, 1000)

    def partition(self, partition_id):
        x, y = self._data(64, partition_id)
        return Split(train=(x[:48], y[:48]), test=(x[48:], y[48:]))

    def train(self, model, data, config, seed):
        x, y = data
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
        for _ in range(config.epochs):
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        return {"loss": loss.item(), "num_examples": len(y)}

    def evaluate(self, model, data):
        x, y = data
        with torch.no_grad():
            out = model(x)
        return {"loss": F.mse_loss(out, y).item(), "mae": (out - y).abs().mean().item(), "num_examples": len(y)}
'''

HELPERS = '''
import torch
from torch import nn


def linear_model(seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(6, 1))
'''


@dataclass(frozen=True)
class Exported:
    project: Path  # the project folder the run's task came from
    out: Path  # the export


def quorum_cli(*args: str) -> Any:
    """``quorum ARGS`` in this process (typer's CliRunner), asserted to succeed."""
    from quorum.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result


def forget(folder: Path) -> None:
    """Delete ``folder`` and forget every module this process imported from it, as if it had never been here."""
    shutil.rmtree(folder, ignore_errors=True)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve().is_relative_to(folder.resolve()):
            del sys.modules[name]
    sys.path[:] = [p for p in sys.path if Path(p).resolve() != folder.resolve()]


def source_file(task: Any) -> Path:
    """The file ``task``'s class was defined in (its module is kept under a private name, not its own)."""
    return Path(type(task).build_model.__code__.co_filename)


def digits(n: int) -> np.ndarray:
    return load_digits().x.reshape(-1, 64)[:n].astype(np.float32)


@pytest.fixture(scope="module")
def new_project(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The project ``quorum new`` writes, run for one round and exported, all through the CLI."""
    root = tmp_path_factory.mktemp("new")
    db = f"sqlite:///{root / 'runs.db'}"
    quorum_cli("new", str(root / "my-project"))
    quorum_cli("simulate", str(root / "my-project" / "scenario.toml"), "--rounds", "1", "--workers", "1",
               "--db", db, "--json")
    run_id = RunStore(db).list_runs()[0].id
    quorum_cli("export", run_id, "--out", str(root / "export"), "--db", db)
    return Exported(root / "my-project", root / "export")


@pytest.fixture(scope="module")
def linear_project(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """A task of its own (also ``task.py``, with a sibling module), run for one round and exported."""
    root = tmp_path_factory.mktemp("linear")
    project = root / "linear-project"
    project.mkdir()
    (project / "task.py").write_text(LINEAR_TASK)
    (project / "helpers.py").write_text(HELPERS)
    spec = scenario_from_dict({"name": "linear", "rounds": 1, "task": {"entry": "task:LinearTask",
                                                                     "path": str(project)},
                               "federation": {"clients": 2, "min_clients": 1},
                               "training": {"local_epochs": 2, "lr": 0.05}}, source="linear")
    db = f"sqlite:///{root / 'runs.db'}"
    export_run(RunStore(db), simulate(spec, db_url=db, workers=1).run_id, root / "export")
    return Exported(project, root / "export")


def test_the_new_project_exports_and_serves_after_its_folder_is_deleted(
        new_project: Exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: what the export answers while the project is still there
    x = digits(4)
    before = TestClient(create_app(new_project.out)).post("/predict", json={"inputs": x.tolist()})
    assert before.status_code == 200, before.text
    with torch.no_grad():
        logits = quorum.load_model(new_project.out)(torch.from_numpy(x))

    # Execute: the project folder is gone, its modules forgotten, and we are somewhere else
    forget(new_project.project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    exported = load_export(new_project.out)
    after = TestClient(create_app(new_project.out)).post("/predict", json={"inputs": x.tolist()})

    # Assert: the same answers, from the task's source copied into the export, imported under a private name
    assert after.status_code == 200, after.text
    assert after.json() == before.json() and len(after.json()["probabilities"][0]) == 10
    with torch.no_grad():
        torch.testing.assert_close(exported.module(torch.from_numpy(x)), logits)
    assert source_file(exported.task) == new_project.out / "source" / "task.py"
    assert "task" not in sys.modules


def test_the_manifest_names_the_task_and_its_metric_not_mnist_or_a_cnn(new_project: Exported) -> None:
    # Execute
    text = (new_project.out / MANIFEST).read_text()
    manifest = json.loads(text)

    # Assert: the run's own task (with its options in full) and its headline metric; nothing it did not use
    assert manifest["task"]["entry"] == "task:MyTask" and manifest["task"]["name"] == "MyTask"
    assert manifest["task"]["options"] == {"hidden": 64, "server_fraction": 0.2}
    assert manifest["input_shape"] == [64] and manifest["output"] == {"kind": "classes", "classes": 10}
    assert manifest["metric"]["name"] == "accuracy" and manifest["metric"]["split"] == "server"
    assert manifest["metric"]["value"] == manifest["metrics"]["server"]["accuracy"]
    assert 0.0 <= manifest["metric"]["value"] <= 1.0
    assert manifest["source"]["files"].keys() == {"task.py"}
    assert "data" not in manifest["scenario"] and "model" not in manifest["scenario"] and "model" not in manifest
    assert "mnist" not in text and '"cnn"' not in text


def test_a_task_with_tuple_data_exports_its_input_shape_features_and_own_metric(linear_project: Exported) -> None:
    # Prepare
    manifest = json.loads((linear_project.out / MANIFEST).read_text())
    forget(linear_project.project)
    client = TestClient(create_app(linear_project.out))
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3) / 10
    named = {name: float(v) for name, v in zip(["a1", "a2", "a3", "b1", "b2", "b3"], x[0].ravel(), strict=True)}

    # Execute: one example by its features' names, one as nested lists
    answer = client.post("/predict", json={"inputs": [named, x[1].tolist()]})
    missing = client.post("/predict", json={"inputs": [{k: v for k, v in named.items() if k != "b2"}]})
    info = client.get("/").json()

    # Assert: the shape of one x of the (x, y) tuples; the task's features; its only metric besides loss
    assert manifest["input_shape"] == [2, 3] and manifest["output"] == {"kind": "values"}
    assert manifest["features"] == info["features"] == ["a1", "a2", "a3", "b1", "b2", "b3"]
    assert manifest["metric"]["name"] == "mae" and info["metric"] == manifest["metric"]
    assert manifest["task"] == {"entry": "task:LinearTask", "name": "LinearTask",
                                "path": str(linear_project.project), "options": {}}
    assert sorted(manifest["source"]["files"]) == ["helpers.py", "task.py"]  # the sibling module it imports
    assert "data" not in manifest["scenario"] and "model" not in manifest["scenario"]
    assert answer.status_code == 200, answer.text
    with torch.no_grad():
        expected = quorum.load_model(linear_project.out)(torch.from_numpy(x)).squeeze(1).tolist()
    np.testing.assert_allclose(answer.json()["predictions"], expected, rtol=1e-6)
    assert missing.status_code == 422 and "missing feature 'b2'" in missing.json()["detail"]


def test_two_exports_whose_tasks_are_both_task_py_load_side_by_side(
        new_project: Exported, linear_project: Exported, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: both projects gone; this process already has a module of its own named "task"
    forget(new_project.project)
    forget(linear_project.project)
    mine = types.ModuleType("task")
    monkeypatch.setitem(sys.modules, "task", mine)

    # Execute
    digits_model = load_export(new_project.out)
    linear_model = load_export(linear_project.out)

    # Assert: two different task classes, each from its own copy; each model still answers; "task" is untouched
    assert type(digits_model.task).__name__ == "MyTask" and type(linear_model.task).__name__ == "LinearTask"
    assert source_file(digits_model.task) == new_project.out / "source" / "task.py"
    assert source_file(linear_model.task) == linear_project.out / "source" / "task.py"
    with torch.no_grad():
        assert digits_model.module(torch.from_numpy(digits(3))).shape == (3, 10)
        assert linear_model.module(torch.zeros(3, 2, 3)).shape == (3, 1)
    assert sys.modules["task"] is mine


def test_an_export_whose_copied_source_was_changed_is_refused(linear_project: Exported, tmp_path: Path) -> None:
    # Prepare: a copy of the export whose task.py was edited afterwards
    copy = tmp_path / "copy"
    shutil.copytree(linear_project.out, copy)
    task = copy / "source" / "task.py"
    task.write_text(task.read_text() + "\nimport os  # a change\n")

    # Execute / Assert
    with pytest.raises(ExportError, match="task.py: not the source the manifest names"):
        quorum.load_model(copy)


@pytest.mark.parametrize(
    ("data", "shape"),
    [
        ((torch.zeros(5, 8), torch.zeros(5)), (8,)),  # an (x, y) tuple
        ([np.zeros((5, 3, 4)), np.zeros(5)], (3, 4)),  # a list
        (types.SimpleNamespace(x=np.zeros((5, 1, 28, 28))), (1, 28, 28)),  # an object with x
        ({"x": np.zeros((5, 10)), "y": np.zeros(5)}, (10,)),  # a mapping
        (DataLoader(TensorDataset(torch.zeros(6, 2, 2), torch.zeros(6)), batch_size=4), (2, 2)),  # first batch
        (TensorDataset(torch.zeros(6, 7), torch.zeros(6)), (7,)),  # first item: no batch dimension
        (None, None),
        ("text", None),
    ],
)
def test_the_shape_of_one_example_is_read_from_data_of_any_form(data: Any, shape: tuple[int, ...] | None) -> None:
    assert example_shape(data) == shape
