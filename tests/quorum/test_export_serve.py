"""Use the trained model (issue 11, item 6): ``quorum export``, ``quorum.load_model``, ``quorum serve``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import uvicorn
from sklearn.datasets import load_diabetes

import quorum
from learning.federation import cached_federation
from learning.models import get_flat
from quorum.errors import ExportError
from quorum.export import MANIFEST, WEIGHTS, export_run, load_export, load_model
from quorum.serve import create_app
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.schema import load_scenario
from tests.conftest import REPO, tiny_scenario, wait_for
from tests.runtimes.processes import free_ports

with warnings.catch_warnings():  # starlette's import-time deprecation (httpx2), not ours
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

SCENARIO = tiny_scenario(name="export-tiny", rounds=1, federation={"deadline_s": 300.0})  # digits, logreg


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A real 1-round run in a store: (db url, run id)."""
    db = f"sqlite:///{tmp_path_factory.mktemp('store') / 'runs.db'}"
    summary = simulate(SCENARIO, db_url=db)
    assert summary.status == "finished"
    return db, summary.run_id


@pytest.fixture(scope="module")
def exported(stored_run: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run exported by the ``quorum export`` command, as a user types it (in-process: the command's
    own process boundary is tested by ``test_serve_refuses_a_non_loopback_host_without_consent``)."""
    from typer.testing import CliRunner

    from quorum.cli import app

    db, run_id = stored_run
    out = tmp_path_factory.mktemp("export") / "model"
    done = CliRunner().invoke(app, ["export", run_id, "--out", str(out), "--db", db])
    assert done.exit_code == 0, done.output
    return out


def test_export_writes_safetensors_and_a_manifest_naming_the_task(exported: Path, stored_run: tuple[str, str]) -> None:
    # Execute
    manifest = json.loads((exported / MANIFEST).read_text())

    # Assert
    assert (exported / WEIGHTS).is_file()
    assert manifest["run"]["id"] == stored_run[1] and manifest["run"]["round"] == 1
    assert manifest["task"]["entry"] == "learning.tasks.classification:ClassificationTask"
    assert manifest["model"] == {"builder": "learning.models.build_model", "name": "logreg",
                                 "input_shape": manifest["input_shape"], "num_classes": 10}
    assert manifest["output"] == {"kind": "classes", "classes": 10}
    assert np.prod(manifest["input_shape"]) == 64
    assert manifest["tensors"] == {"1.weight": [10, 64], "1.bias": [10]}


def test_load_model_returns_the_runs_global_model(exported: Path, stored_run: tuple[str, str]) -> None:
    # Prepare
    db, run_id = stored_run
    store = RunStore(db)
    test = cached_federation(SCENARIO).test

    # Execute
    model = quorum.load_model(exported)

    # Assert: the checkpoint's numbers, and the run's recorded server accuracy on the held-out set
    assert isinstance(model, torch.nn.Module) and not model.training
    np.testing.assert_array_equal(get_flat(model), store.load_state(run_id).params)
    with torch.no_grad():
        predicted = model(torch.as_tensor(test.x)).argmax(1).numpy()
    assert float(np.mean(predicted == test.y)) == pytest.approx(store.rounds(run_id)[-1].server_accuracy)


def test_export_of_a_round_not_committed_fails_with_the_reason(stored_run: tuple[str, str], tmp_path: Path) -> None:
    db, run_id = stored_run
    with pytest.raises(ExportError, match="has no checkpoint of round 7"):
        export_run(RunStore(db), run_id, tmp_path / "out", server_round=7)


def test_tampered_weights_are_refused(exported: Path, tmp_path: Path) -> None:
    # Prepare: a copy whose weights were swapped after export
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / MANIFEST).write_bytes((exported / MANIFEST).read_bytes())
    data = bytearray((exported / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (copy / WEIGHTS).write_bytes(bytes(data))
    # Execute / Assert
    with pytest.raises(ExportError, match="SHA-256 differs"):
        quorum.load_model(copy)


@pytest.fixture(scope="module")
def client(exported: Path) -> TestClient:
    return TestClient(create_app(exported, max_batch=8))


def test_predict_answers_a_batch(client: TestClient, exported: Path) -> None:
    # Prepare: three held-out digits, as nested lists of the declared shape
    test = cached_federation(SCENARIO).test
    model = load_export(exported).module

    # Execute
    response = client.post("/predict", json={"inputs": test.x[:3].tolist()})

    # Assert: the module's own predictions, with probabilities that sum to one
    assert response.status_code == 200, response.text
    body = response.json()
    with torch.no_grad():
        expected = model(torch.as_tensor(test.x[:3])).argmax(1).tolist()
    assert body["predictions"] == expected
    assert np.allclose(np.sum(body["probabilities"], axis=1), 1.0, atol=1e-5)
    flat = client.post("/predict", json={"inputs": test.x[:3].reshape(3, -1).tolist()})
    assert flat.json()["predictions"] == expected  # flattened examples are accepted too


@pytest.mark.parametrize(
    ("payload", "status", "reason"),
    [
        ({"inputs": [[0.0] * 10]}, 422, r"inputs have shape \[1, 10\]: each example must have shape \[.*\] "
                                        r"\(or be a flat list of 64 numbers\)"),
        ({"inputs": [[0.0] * 64, [0.0] * 63]}, 422, "not a rectangular batch"),
        ({"inputs": [[0.0] * 64] * 9}, 413, "9 examples: at most 8 per request"),
        ({"inputs": []}, 422, "at least one example"),
        ({"rows": [[0.0] * 64]}, 422, r'expected a JSON object \{"inputs"'),
        ({"inputs": [["a"] * 64]}, 422, "not a rectangular batch of numbers"),
    ],
)
def test_predict_refuses_what_does_not_fit(client: TestClient, payload: dict, status: int, reason: str) -> None:
    response = client.post("/predict", json=payload)
    assert response.status_code == status
    assert re.search(reason, response.json()["detail"])


def test_predict_refuses_non_finite_values_and_non_json(client: TestClient) -> None:
    nan = client.post("/predict", content='{"inputs": [[NaN' + ", 0" * 63 + "]]}",
                      headers={"content-type": "application/json"})
    assert nan.status_code == 422 and "NaN is not a finite number" in nan.json()["detail"]
    text = client.post("/predict", content="inputs=1", headers={"content-type": "text/plain"})
    assert text.status_code == 415


@pytest.fixture
def live_server(exported: Path) -> Iterator[str]:
    """``create_app`` under uvicorn on a loopback port this test picked; stopped at the end."""
    port = free_ports(1)[0]
    server = uvicorn.Server(uvicorn.Config(create_app(exported), host="127.0.0.1", port=port, log_level="warning",
                                           ws="none"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, f"uvicorn serving the exported model on port {port}")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.e2e  # a real listening socket (uvicorn)
def test_predict_over_http(live_server: str) -> None:
    # Prepare
    test = cached_federation(SCENARIO).test
    body = json.dumps({"inputs": test.x[:2].tolist()}).encode()
    request = urllib.request.Request(f"{live_server}/predict", data=body,
                                     headers={"content-type": "application/json"})

    # Execute
    with urllib.request.urlopen(request, timeout=30) as response:
        answer = json.loads(response.read())
    with urllib.request.urlopen(f"{live_server}/", timeout=30) as response:
        info = json.loads(response.read())

    # Assert
    assert len(answer["predictions"]) == 2 and all(0 <= p < 10 for p in answer["predictions"])
    assert info["output"] == {"kind": "classes", "classes": 10} and info["max_batch"] == 256
    bad = urllib.request.Request(f"{live_server}/predict", data=b'{"inputs": [[1, 2]]}',
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=30)
    assert refused.value.code == 422 and "each example must have shape" in refused.value.read().decode()


@pytest.mark.e2e
def test_serve_refuses_a_non_loopback_host_without_consent(exported: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "quorum", "serve", str(exported), "--host", "0.0.0.0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not loopback" in done.stderr


def test_a_regression_task_exports_and_serves_values(tmp_path: Path) -> None:
    # Prepare: one round of the built-in regression task (a task with no classes)
    spec = load_scenario(REPO / "scenarios" / "regression.toml").with_overrides(rounds=1)
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id = simulate(spec, db_url=db).run_id

    # Execute
    export_run(RunStore(db), run_id, tmp_path / "model")
    client = TestClient(create_app(tmp_path / "model"))
    answer = client.post("/predict", json={"inputs": [[0.0] * 10, [0.5] * 10]})

    # Assert: the task's reference and the raw outputs, one value per example
    manifest = load_export(tmp_path / "model").manifest
    assert manifest["task"]["entry"] == "learning.tasks.regression:RegressionTask" and "model" not in manifest
    assert manifest["input_shape"] == [10] and manifest["output"] == {"kind": "values"}
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["predictions"]) == 2 and all(isinstance(v, float) for v in answer.json()["predictions"])


def test_an_exported_regressor_takes_raw_features_and_predicts_in_the_targets_units(tmp_path: Path) -> None:
    # Prepare: the diabetes regression, exported; the raw data straight from scikit-learn
    spec = load_scenario(REPO / "scenarios" / "regression.toml").with_overrides(rounds=2)
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    export_run(RunStore(db), simulate(spec, db_url=db).run_id, tmp_path / "model")
    x, y = load_diabetes(return_X_y=True, scaled=False)

    # Execute
    module = load_model(tmp_path / "model")
    with torch.no_grad():
        served = module(torch.as_tensor(x, dtype=torch.float32)).squeeze(-1).numpy()
        standard = module.model(torch.as_tensor((x - x.mean(0)) / x.std(0), dtype=torch.float32)).squeeze(-1)

    # Assert: the served module is the trained one between the data set's standardisation and its
    # inverse, so its predictions sit in the target's range (a standard-units model predicts near 0)
    np.testing.assert_allclose(served, standard.numpy() * y.std() + y.mean(), rtol=1e-4, atol=1e-3)
    assert abs(served.mean() - y.mean()) < y.std()
    assert np.mean(np.abs(served - y)) < np.mean(np.abs(y - y.mean()))  # better than the mean after 2 rounds


WRAPPED_TASK = '''
from torch import nn

from learning.tasks.classification import ClassificationTask


class WrappedTask(ClassificationTask):
    """The built-in classifier, served as probabilities."""

    def serving_module(self, model):
        return nn.Sequential(model, nn.Softmax(dim=1))
'''


def test_a_task_that_wraps_its_model_for_serving_exports_and_loads_the_wrapper(tmp_path: Path) -> None:
    # Prepare: a classification task whose serving module adds a softmax
    (tmp_path / "wrapped_task.py").write_text(WRAPPED_TASK)
    spec = tiny_scenario(rounds=1, task={"entry": "wrapped_task:WrappedTask", "path": str(tmp_path)})
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    export_run(RunStore(db), simulate(spec, db_url=db).run_id, tmp_path / "model")

    # Execute
    exported = load_export(tmp_path / "model")
    x = torch.as_tensor(cached_federation(spec).test.x[:5], dtype=torch.float32)
    with torch.no_grad():
        out = exported.module(x)

    # Assert: rebuilt through the task (not the built-in builder), so the wrapper's weights load strictly
    assert "model" not in exported.manifest
    assert isinstance(exported.module, torch.nn.Sequential) and isinstance(exported.module[1], torch.nn.Softmax)
    np.testing.assert_allclose(out.sum(dim=1).numpy(), 1.0, rtol=1e-5)
