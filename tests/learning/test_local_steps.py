"""``[training] local_steps``: exactly K optimiser steps a round, cycling the data, on every path to the task."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from aggregator.step import train_config
from clients.clientapp import app
from core.instructions import TrainConfig, train_instruction
from core.replies import parse_train_reply
from learning import training
from learning.datasets import ArrayDataset
from learning.federation import cached_federation
from learning.models import build_model, get_flat
from learning.task import load_task
from learning.training import train
from runtimes.inprocess import InProcessGrid, NodeSpec
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, scenario_from_dict
from tests.aggregator.linear_task import Rows, mse
from tests.conftest import tiny_scenario


def _linear(w: list[float]) -> nn.Linear:
    model = nn.Linear(len(w), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([w]))
    return model


@pytest.fixture
def optimizer_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every optimiser step taken while the test runs, counted: the local SGD's (``learning.training._SGD``)
    and any torch optimiser's."""
    taken: list[int] = []
    step = training._SGD.step

    def counted(self: training._SGD) -> None:
        step(self)
        taken.append(1)

    monkeypatch.setattr(training._SGD, "step", counted)
    handle = register_optimizer_step_post_hook(lambda *_: taken.append(1))
    yield taken
    handle.remove()


def _steps_scenario(steps: int) -> Scenario:
    raw = tiny_scenario().to_dict()
    raw["training"] = {"local_steps": steps, "batch_size": 16, "lr": 0.1}
    return scenario_from_dict(raw, source="steps")


@pytest.mark.parametrize(("steps", "epochs", "expected"), [(7, 1, 7), (2, 1, 2), (0, 2, 6), (30, 5, 30)])
def test_steps_count_the_optimiser_steps_taken_not_epochs(optimizer_steps: list[int], steps: int, epochs: int,
                                                          expected: int) -> None:
    # Prepare: 10 examples in batches of 4 are 3 batches a pass
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.normal(size=(10, 4)).astype(np.float32), np.arange(10, dtype=np.int64) % 3)

    # Execute
    result = train(build_model("logreg", (4,), 3, seed=0), data, epochs=epochs, batch_size=4, lr=0.1, seed=1,
                   steps=steps)

    # Assert: 7 steps cycle the data (3 + 3 + 1), 2 stop inside the first pass; epochs count only without steps
    assert len(optimizer_steps) == expected == result.steps


def test_three_full_batch_steps_match_sgd_worked_out_in_numpy() -> None:
    # Prepare: 2 examples, batch 2: every step is a new pass, so the order cannot matter
    x, y, w, lr = np.array([[1.0, 2.0], [3.0, -1.0]]), np.array([1.0, 0.0]), np.array([0.5, -1.0]), 0.1
    model = _linear(list(w))
    expected = w.copy()
    for _ in range(3):  # mean squared error: grad = 2/n X^T (X w - y)
        expected = expected - lr * 2 / len(y) * x.T @ (x @ expected - y)

    # Execute
    result = train(model, Rows(x.astype(np.float32), y.astype(np.float32)), epochs=5, batch_size=2, lr=lr, seed=0,
                   loss_fn=mse, steps=3)

    # Assert: (0.5, -1) -> (0, -0.25) -> (0.075, 0.075) -> (0.1075, 0.245); epochs = 5 does not apply
    np.testing.assert_allclose(expected, [0.1075, 0.245], rtol=1e-12)
    np.testing.assert_allclose(model.weight.detach().numpy()[0], expected, rtol=1e-5)
    assert result.steps == 3


def test_steps_past_a_pass_cycle_the_data_in_a_fresh_order() -> None:
    # Prepare: 3 examples in batches of 2: step 1 takes 2 of the first order, step 2 the third, step 3
    # two of a second order, drawn from the same generator as the first
    x = np.array([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
    y, w, lr, seed = np.array([1.0, -1.0, 0.5]), np.array([0.2, 0.3]), 0.05, 11
    generator = torch.Generator().manual_seed(seed)
    first, second = (torch.randperm(3, generator=generator).numpy() for _ in range(2))
    expected = w.copy()
    for rows in (first[:2], first[2:], second[:2]):
        xb, yb = x[rows], y[rows]
        expected = expected - lr * 2 / len(yb) * xb.T @ (xb @ expected - yb)
    model = _linear(list(w))

    # Execute
    train(model, Rows(x.astype(np.float32), y.astype(np.float32)), epochs=1, batch_size=2, lr=lr, seed=seed,
          loss_fn=mse, steps=3)

    # Assert
    np.testing.assert_allclose(model.weight.detach().numpy()[0], expected, rtol=1e-5)


def test_the_round_instruction_carries_the_scenarios_steps() -> None:
    scenario = _steps_scenario(9)
    assert train_config(scenario, None, 2).steps == 9
    assert train_config(tiny_scenario(), None, 2).steps == 0


@pytest.fixture
def flower_identity() -> Iterator[None]:
    """Flower's task identity, as a runtime sets it (a Message needs it)."""
    with InProcessGrid(app, [NodeSpec(1)], run_config={}):
        yield


@pytest.mark.usefixtures("flower_identity")
def test_the_clientapp_trains_the_builtin_task_for_the_rounds_steps(optimizer_steps: list[int]) -> None:
    # Prepare: partition 2 of the tiny federation has far more than 3 batches of 16
    scenario = _steps_scenario(3)
    fed = cached_federation(scenario)
    params = get_flat(build_model("logreg", fed.input_shape, fed.num_classes, seed=scenario.seed))
    config = train_config(scenario, None, 1)
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 2, "num-partitions": 4}, state=RecordDict(),
                      run_config={"scenario-json": json.dumps(scenario.to_dict())})
    message = Message(train_instruction(params, config), 7, "train", group_id="1")
    message.metadata.__dict__["_message_id"] = "train-7"

    # Execute
    reply = app(message, context)

    # Assert
    assert len(optimizer_steps) == 3
    assert np.abs(parse_train_reply(reply.content, params.size, 1 << 20).delta).max() > 0


def test_a_flower_servers_local_epochs_replace_the_scenarios_steps() -> None:
    defaults = TrainConfig(round=0, epochs=1, batch_size=8, lr=0.1, seed=0, steps=40)
    assert defaults.updated_by(ConfigRecord({"local-epochs": 2})).steps == 0
    assert defaults.updated_by(ConfigRecord({"lr": 0.5})).steps == 40


def test_a_task_that_does_not_take_steps_is_refused_by_name(tmp_path: Path) -> None:
    # Prepare: a user's task whose train loop reads only config.epochs
    (tmp_path / "epochs_only.py").write_text(
        "from learning.tasks.classification import ClassificationTask\n"
        "class EpochsOnly(ClassificationTask):\n"
        "    supports_local_steps = False\n")
    raw = _steps_scenario(5).to_dict()
    raw["task"] = {"entry": "epochs_only:EpochsOnly", "path": str(tmp_path)}

    # Execute / Assert
    with pytest.raises(ScenarioError, match=r"training.local_steps = 5: EpochsOnly.train does not say it takes "
                                            r"config.steps \(supports_local_steps\)"):
        load_task(scenario_from_dict(raw, source="mine.toml"))
