"""Flower compatibility both ways (issue 11, item 3), in-process.

The clients are a user's Flower app, ``tests/runtimes/flower_quickstart``:
written the way Flower 1.42's own quickstart writes them (``@app.train()`` /
``@app.evaluate()`` reading ``msg.content["arrays"]`` and
``msg.content["config"]["lr"]``, answering ``arrays`` plus a ``metrics``
MetricRecord with ``num-examples``), and as a legacy ``NumPyClient`` behind a
``client_fn``: nothing in them knows Quorum's own layout. The model is the
scenario's (McMahan's 2NN on sklearn digits), written as a user writes it.
Their training loop is plain SGD with its shuffle seeded as Quorum's client
seeds its own, so the runs differ only in the wire path and "the same
accuracy" is checked tightly. The same app runs on a SuperLink in
``test_deployment.py``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

from aggregator.serverapp import run_federation
from clients.clientapp import app as quorum_client_app
from learning.federation import cached_federation
from learning.task import TaskModel, load_task
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from scenarios.schema import Scenario
from tests.conftest import tiny_scenario
from tests.runtimes.flower_quickstart.client_app import Net, legacy_app, score_fn
from tests.runtimes.flower_quickstart.client_app import app as flower_app

ROUNDS = 6


def scenario() -> Scenario:
    return tiny_scenario(name="flower-compat", rounds=ROUNDS, model={"name": "mlp"}, training={"local_epochs": 2},
                         federation={"deadline_s": 300.0},  # a loaded machine must not drop a client
                         evaluation={"federated": True, "server": True, "every": 1})


# -- runs --------------------------------------------------------------------------------------------


def run_config(spec: Scenario) -> dict[str, object]:
    """What a Flower app's pyproject would give every node, plus Quorum's scenario for its own client."""
    return {"scenario-json": json.dumps(spec.to_dict()), "local-epochs": spec.training.local_epochs,
            "batch-size": spec.training.batch_size}


def nodes(spec: Scenario) -> list[NodeSpec]:
    n = spec.federation.clients
    return [NodeSpec(i + 1, {"partition-id": i, "num-partitions": n}) for i in range(n)]


def run_under_quorum(client_app: ClientApp, db_url: str) -> tuple[RunStore, str, str]:
    spec = scenario()
    store = RunStore(db_url)
    with InProcessGrid(client_app, nodes(spec), run_config(spec)) as grid:
        run_id, result = run_federation(grid, spec, store, engine="inprocess")
    return store, run_id, result.status


@pytest.fixture(scope="module")
def quorum_accuracy(tmp_path_factory: pytest.TempPathFactory) -> float:
    """Quorum's own client on the same model, data and settings: the figure to match."""
    store, run_id, status = run_under_quorum(quorum_client_app, f"sqlite:///{tmp_path_factory.mktemp('q')}/r.db")
    assert status == "finished"
    return store.rounds(run_id)[-1].server_accuracy


@pytest.mark.parametrize("client_app", [flower_app, legacy_app], ids=["message-api", "legacy-numpyclient"])
def test_a_stock_flower_client_federates_under_quorums_serverapp(client_app: ClientApp, db_url: str,
                                                                  quorum_accuracy: float) -> None:
    # Execute: Quorum's ServerApp logic drives clients that only speak Flower's layouts
    store, run_id, status = run_under_quorum(client_app, db_url)

    # Assert: every round took every client's update, and the model learned as much as with Quorum's client
    rounds = store.rounds(run_id)
    assert status == "finished"
    assert [r.answered for r in rounds] == [4] * ROUNDS
    assert all(r.metrics["status"] == "ok" for r in rounds)
    assert rounds[-1].server_accuracy == pytest.approx(quorum_accuracy, abs=0.01)
    assert rounds[-1].server_accuracy > 0.85
    assert rounds[-1].fed_accuracy > 0.85  # the clients' own evaluate replies were read too
    train_losses = [c.train_loss for c in store.client_results(run_id, ROUNDS)]
    assert all(loss is not None and 0 < loss < 1 for loss in train_losses)  # Flower's train_loss, read


def test_quorums_client_answers_flowers_own_fedavg_serverapp(quorum_accuracy: float) -> None:
    # Prepare: a stock Flower ServerApp with Flower's message-API FedAvg, as `flwr new` writes it, starting
    # from the scenario's initial model with its learning rate, for as many rounds as Quorum's own run
    spec = scenario()
    server_app = ServerApp()
    outcome = {}
    initial = TaskModel.build(load_task(spec), spec.seed).model.state_dict()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FlowerFedAvg(fraction_train=1.0, fraction_evaluate=1.0)
        outcome["result"] = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial),
                                           train_config=ConfigRecord({"lr": spec.training.lr}), num_rounds=ROUNDS)

    # Execute: Quorum's ClientApp on every node
    with InProcessGrid(quorum_client_app, nodes(spec), run_config(spec)) as grid:
        server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))

    # Assert: Flower aggregated Quorum's replies (one ArrayRecord, one MetricRecord each) into the model
    # Quorum's own ServerApp trains with the same clients: within 2 points on the same held-out set
    result = outcome["result"]
    model = Net()
    model.load_state_dict(result.arrays.to_torch_state_dict())
    test = cached_federation(spec).test
    _, accuracy = score_fn(model, (torch.as_tensor(test.x, dtype=torch.float32), torch.as_tensor(test.y)))
    print(f"Quorum's ClientApp, {ROUNDS} rounds: Flower's FedAvg {accuracy:.4f}, Quorum's ServerApp "
          f"{quorum_accuracy:.4f}")
    assert accuracy == pytest.approx(quorum_accuracy, abs=0.02)
    assert accuracy > 0.8
    assert set(result.train_metrics_clientapp) == set(range(1, ROUNDS + 1))
    assert set(result.evaluate_metrics_clientapp[ROUNDS]) == {"eval_loss", "eval_acc"}
    assert result.evaluate_metrics_clientapp[ROUNDS]["eval_acc"] > 0.8
    assert math.isfinite(result.train_metrics_clientapp[ROUNDS]["train_loss"])


def garbage_app(message: Message, context: Context) -> Message:
    if message.metadata.message_type == "evaluate":
        return Message(RecordDict({"metrics": MetricRecord({"score": 1.0})}), reply_to=message)
    return Message(RecordDict({"weights": ConfigRecord({"w": [1.0, 2.0]})}), reply_to=message)


def test_a_reply_in_no_known_layout_is_rejected_with_what_was_expected(db_url: str) -> None:
    # Execute
    spec = scenario()
    store = RunStore(db_url)
    with InProcessGrid(garbage_app, nodes(spec), run_config(spec)) as grid:
        run_id, result = run_federation(grid, spec, store, engine="inprocess")

    # Assert: every client rejected with the reason naming the three layouts; the run failed, not finished
    clients = store.client_results(run_id, 1)
    assert {c.outcome for c in clients} == {"rejected"}
    reason = clients[0].reason
    assert "no 'update'/'delta' array" in reason and "'arrays'" in reason and "'fitres.parameters'" in reason
    assert "got ['weights']" in reason
    assert result.status == "failed"
    assert np.isnan(store.rounds(run_id)[-1].fed_accuracy or np.nan)  # no evaluate reply was readable either
