"""Flower's official quickstart-sklearn and quickstart-numpy, unchanged but for their data, under Quorum's ServerApp.

Each app (``README.md`` beside this file shows the one data-loader change) runs
in-process twice on the same nodes, data and rounds: under Quorum's ServerApp
(``aggregator.flower_app.serve_flower_app``: the app's own run-config keys and
model, no Quorum task) and under Flower's stock ``FedAvg`` driven on the same
in-process ``Grid`` as the app's own ``server_app.py`` drives it. Quorum must
end within 2 points of Flower's federated accuracy (issue 33, item 2).
"""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.result import Result

from aggregator.flower_app import FlowerApp, read_app, serve_flower_app
from clients.clientapp import app as quorum_client_app
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec

HERE = Path(__file__).resolve().parent


def _nodes(count: int) -> list[NodeSpec]:
    """The app's ``options.num-supernodes`` nodes, with the node config Flower's simulation gives them."""
    return [NodeSpec(i + 1, {"partition-id": i, "num-partitions": count}) for i in range(count)]


def _client_app(app: FlowerApp) -> ClientApp:
    module, _, attr = app.clientapp.partition(":")
    return getattr(importlib.import_module(module), attr)


@pytest.fixture
def seeded() -> Iterator[None]:
    """Both runs draw from numpy's global generator (scikit-learn's SAGA shuffle, quickstart-numpy's noise) and
    Flower's FedAvg samples nodes with :mod:`random`: each run starts both from a stated seed, and the suite's
    own states are put back afterwards."""
    states = np.random.get_state(), random.getstate()
    yield
    np.random.set_state(states[0])
    random.setstate(states[1])


def _seed(seed: int) -> None:
    np.random.seed(seed)
    random.seed(seed)


def _open(name: str, monkeypatch: pytest.MonkeyPatch) -> FlowerApp:
    """The vendored app, importable as ``flwr run`` makes it (its folder first on ``sys.path``)."""
    folder = HERE / name
    monkeypatch.syspath_prepend(str(folder))
    return read_app(folder)


def run_under_quorum(app: FlowerApp, supernodes: int, db_url: str, seed: int = 0) -> tuple[RunStore, str, str]:
    _seed(seed)
    store = RunStore(db_url)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=dict(app.config))
    with InProcessGrid(_client_app(app), _nodes(supernodes), app.config) as grid:
        run_id, result = serve_flower_app(grid, context, store, app=app, engine="inprocess", wait_s=5.0)
    return store, run_id, result.status


def run_under_flower(app: FlowerApp, supernodes: int, strategy: FedAvg, initial: ArrayRecord,
                     seed: int = 0) -> Result:
    _seed(seed)
    with InProcessGrid(_client_app(app), _nodes(supernodes), app.config) as grid:
        return strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(app.config["num-server-rounds"]))


#: Seeds each side runs with: the example's accuracy on its 30 test rows swings by up to 30 points from one round
#: to the next (one SAGA pass on unscaled features), and from one seed to the next, so the figure compared is
#: the mean federated accuracy of the last 10 rounds, over these seeds, on each side.
SEEDS, LAST = (0, 1, 2), 10


def test_quickstart_sklearn_under_quorum_matches_flowers_fedavg(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path, seeded: None) -> None:
    # Prepare: the app as pyproject.toml describes it (3 supernodes, 25 rounds, penalty "l2")
    app = _open("quickstart-sklearn", monkeypatch)
    task = importlib.import_module("sklearnexample.task")
    flower_scores, quorum_scores = [], []

    for seed in SEEDS:
        # Execute: Flower's FedAvg as sklearnexample/server_app.py runs it, then Quorum's ServerApp
        initial = ArrayRecord(task.get_model_params(task.create_log_reg_and_instantiate_parameters("l2")))
        flower = run_under_flower(app, 3, FedAvg(fraction_train=1.0, fraction_evaluate=1.0), initial, seed)
        store, run_id, status = run_under_quorum(app, 3, f"sqlite:///{tmp_path}/runs-{seed}.db", seed)

        # Assert: every round took every client's Fortran-ordered float64 coef_, read its test_logloss / accuracy
        rounds = store.rounds(run_id)
        assert status == "finished"
        assert len(rounds) == 25 and all(r.answered == 3 and r.metrics["status"] == "ok" for r in rounds)
        assert all(r.fed_loss is not None and r.fed_accuracy is not None for r in rounds)
        clients = store.client_results(run_id, 25)
        assert all(c.eval_accuracy is not None and c.train_loss is not None for c in clients)  # train_logloss
        assert all(c.bytes_in >= 15 * 8 for c in clients)  # 15 float64 values received, counted as received
        per_round = flower.evaluate_metrics_clientapp
        flower_scores.append(np.mean([per_round[r]["accuracy"] for r in range(26 - LAST, 26)]))
        quorum_scores.append(np.mean([r.fed_accuracy for r in rounds[-LAST:]]))

    # Assert: as accurate as plain Flower, within 2 points
    assert np.mean(flower_scores) > 0.85
    assert abs(np.mean(quorum_scores) - np.mean(flower_scores)) <= 0.02, (quorum_scores, flower_scores)


def run_quorums_clients_under_flower(app: FlowerApp, supernodes: int, task: dict, strategy: FedAvg,
                                    initial: ArrayRecord, seed: int = 0) -> Result:
    """The other way round: the app's own stock ServerApp (Flower's FedAvg) with Quorum's ClientApp on every node,
    given a scenario whose ``[task]`` holds the app's model, data and training (``quorum_task.py`` beside it)."""
    scenario = {"name": app.name, "seed": seed, "federation": {"clients": supernodes}, "task": task}
    run_config = {**app.config, "scenario-json": json.dumps(scenario)}
    _seed(seed)
    with InProcessGrid(quorum_client_app, _nodes(supernodes), run_config) as grid:
        return strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(app.config["num-server-rounds"]))


def test_quickstart_sklearn_on_quorums_clientapp_under_its_own_serverapp_matches_flower(
        monkeypatch: pytest.MonkeyPatch, seeded: None) -> None:
    # Prepare: the example's model, data and training moved into a Quorum task (quorum_task.py: the example's
    # task.py called unchanged, its client_app.py's bodies), its server_app.py's FedAvg and initial arrays
    app = _open("quickstart-sklearn", monkeypatch)
    example = importlib.import_module("sklearnexample.task")
    task = {"entry": "quorum_task:SklearnExampleTask", "path": str(HERE / "quickstart-sklearn"),
            "penalty": app.config["penalty"]}
    flower_scores, quorum_scores = [], []

    for seed in SEEDS:
        # Execute: plain Flower (the example's ClientApp), then Quorum's ClientApp, each under the example's FedAvg
        def initial() -> ArrayRecord:
            model = example.create_log_reg_and_instantiate_parameters(app.config["penalty"])
            return ArrayRecord(example.get_model_params(model))  # keys "0", "1": read by position

        flower = run_under_flower(app, 3, FedAvg(fraction_train=1.0, fraction_evaluate=1.0), initial(), seed)
        quorum = run_quorums_clients_under_flower(app, 3, task, FedAvg(fraction_train=1.0, fraction_evaluate=1.0),
                                                  initial(), seed)

        # Assert: every round aggregated Quorum's replies (Flower's layout: eval_loss, eval_acc, num-examples)
        assert sorted(quorum.evaluate_metrics_clientapp) == list(range(1, 26))
        assert all(quorum.train_metrics_clientapp[r]["train_loss"] > 0 for r in range(1, 26))
        coef, intercept = quorum.arrays.to_numpy_ndarrays()
        assert coef.shape == (3, 4) and intercept.shape == (3,)
        flower_scores.append(np.mean([flower.evaluate_metrics_clientapp[r]["accuracy"] for r in range(26 - LAST, 26)]))
        quorum_scores.append(np.mean([quorum.evaluate_metrics_clientapp[r]["eval_acc"] for r in range(26 - LAST, 26)]))

    # Assert: as accurate as the example's own clients, within 2 points
    print(f"quickstart-sklearn under its own ServerApp: the example's clients {np.mean(flower_scores):.4f}, "
          f"Quorum's {np.mean(quorum_scores):.4f}")
    assert np.mean(flower_scores) > 0.85
    assert abs(np.mean(quorum_scores) - np.mean(flower_scores)) <= 0.02, (quorum_scores, flower_scores)


def test_quickstart_numpy_under_quorum_matches_flowers_fedavg(monkeypatch: pytest.MonkeyPatch, db_url: str,
                                                               seeded: None) -> None:
    # Prepare: 10 supernodes, 3 rounds; the model is one 1x1 float64 array of ones
    app = _open("quickstart-numpy", monkeypatch)
    task = importlib.import_module("quickstart_numpy.task")

    # Execute: Flower's FedAvg as quickstart_numpy/server_app.py runs it, then Quorum's ServerApp
    flower = run_under_flower(app, 10, FedAvg(), ArrayRecord(task.get_dummy_model()))
    store, run_id, status = run_under_quorum(app, 10, db_url)

    # Assert: each round adds the mean of ten U(0, 1) draws (about 0.5): both end near 2.5, and together
    rounds = store.rounds(run_id)
    assert status == "finished"
    assert len(rounds) == 3 and all(r.answered == 10 and r.metrics["status"] == "ok" for r in rounds)
    flower_value = float(flower.arrays.to_numpy_ndarrays()[0].item())
    state = store.load_state(run_id)
    assert state is not None
    quorum_value = float(state.params.item())
    assert abs(flower_value - 2.5) < 0.6 and abs(quorum_value - 2.5) < 0.6
    assert abs(quorum_value - flower_value) < 0.05  # the same draws, in the same order
