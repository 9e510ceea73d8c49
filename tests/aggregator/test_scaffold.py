"""SCAFFOLD (Karimireddy et al., ICML 2020, option II): client and server against updates worked out in numpy,
the node's control variate kept across rounds, the combinations it refuses, and the drift it corrects."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict

from aggregator.serverapp import build_strategy
from aggregator.strategies import Scaffold
from clients.clientapp import CONTROL_KEY, app
from core.instructions import SCAFFOLD_CONTROL, TrainConfig, control_of, train_instruction, with_control
from core.replies import parse_train_reply
from core.strategy import ServerState
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.parallel.errors import ParallelError
from runtimes.parallel.job import check_scenario
from runtimes.parallel.mode import Mode
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, scenario_from_dict
from tests.aggregator.linear_task import ROWS, W0
from tests.conftest import tiny_scenario

LR, K = 0.1, 3


def _reference_client(x: np.ndarray, rows: int, c: np.ndarray, c_i: np.ndarray) -> tuple[np.ndarray, ...]:
    """Algorithm 1 of the paper for one client in float64: K corrected full-batch steps on the MSE of
    ``ROWS[rows]``, then option II. Returns (y_i - x, c_i+ - c_i, c_i+), in gradient units."""
    features, targets = ROWS[rows]
    y = x.copy()
    for _ in range(K):
        grad = 2 / len(targets) * features.T @ (features @ y - targets)
        y = y - LR * (grad + c - c_i)
    c_new = c_i - c + (x - y) / (K * LR)
    return y - x, c_new - c_i, c_new


def _linear_scenario(clients: int = 2, rounds: int = 1, **sections: Any) -> Scenario:
    raw: dict[str, Any] = {
        "name": "scaffold-linear", "seed": 1, "rounds": rounds,
        "task": {"entry": "tests.aggregator.linear_task:LinearTask"},
        "federation": {"clients": clients, "min_clients": 1, "weighting": "uniform", "deadline_s": 60.0},
        "training": {"local_steps": K, "batch_size": 2, "lr": LR},
        "strategy": {"name": "scaffold", "server_lr": 1.0},
        "evaluation": {"federated": False, "server": False},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return scenario_from_dict(raw, source="scaffold")


@pytest.fixture
def flower_identity() -> Iterator[None]:
    """Flower's task identity, as a runtime sets it (a Message needs it)."""
    with InProcessGrid(app, [NodeSpec(1)], run_config={}):
        yield


def _train_message(x: np.ndarray, control_steps: np.ndarray, server_round: int) -> Message:
    config = with_control(TrainConfig(round=server_round, epochs=1, batch_size=2, lr=LR, seed=1, steps=K),
                          control_steps)
    message = Message(train_instruction(x.astype(np.float32), config), 7, "train", group_id=str(server_round))
    message.metadata.__dict__["_message_id"] = f"train-{server_round}"
    return message


# -- the server ----------------------------------------------------------------------------------------------


def test_server_step_moves_x_by_the_mean_delta_and_c_by_the_answered_share() -> None:
    # Prepare: N = 4 clients, 2 answer with weights 1 and 3; server_lr 0.5
    strategy = Scaffold(server_lr=0.5, population=4)
    state = ServerState.initial(np.array([1.0, 2.0], dtype=np.float32))
    state = state.advanced(state.params, c=np.array([0.1, -0.1], dtype=np.float32))
    first, second = np.array([0.4, -0.8, 0.2, 0.6]), np.array([-0.4, 0.4, -0.2, 0.2])
    mean = (1 * first + 3 * second) / 4  # [dy, dc] = [-0.2, 0.1, -0.1, 0.3]

    # Execute
    bound = strategy.for_round(state)
    agg = bound.new_aggregate(2)
    for update, weight in ((first, 1.0), (second, 3.0)):
        agg = bound.accumulate(agg, update.astype(np.float32), weight)
    new = bound.apply(state, bound.finalize(agg, np.random.default_rng(0)))

    # Assert: x = (1, 2) + 0.5 (-0.2, 0.1); c = (0.1, -0.1) + 2/4 (-0.1, 0.3)
    np.testing.assert_allclose(new.params, [1.0 + 0.5 * mean[0], 2.0 + 0.5 * mean[1]], rtol=1e-6)
    np.testing.assert_allclose(new.params, [0.9, 2.05], rtol=1e-6)
    np.testing.assert_allclose(new.slots["c"], [0.05, 0.05], rtol=1e-6, atol=1e-7)


def test_the_round_instruction_carries_the_servers_control_variate() -> None:
    strategy = build_strategy(_linear_scenario(clients=3))
    assert isinstance(strategy, Scaffold) and strategy.population == 3
    state = ServerState.initial(np.zeros(2, dtype=np.float32))
    state = state.advanced(state.params, c=np.array([0.25, -2.0], dtype=np.float32))
    config = strategy.for_round(state).configure_train(TrainConfig(round=1, epochs=1, batch_size=2, lr=LR, seed=0))
    np.testing.assert_array_equal(control_of(config, 2), [0.25, -2.0])
    assert isinstance(config.get(SCAFFOLD_CONTROL), bytes)
    with pytest.raises(RuntimeError, match="for_round"):
        strategy.configure_train(config)  # not bound to a round: it would send no control
    with pytest.raises(ValueError, match="not 3 float32 values"):
        control_of(config, 3)


# -- the client ----------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("flower_identity")
def test_client_rounds_match_algorithm_1_and_keep_c_i_in_the_node_state() -> None:
    # Prepare: node 7 holds ROWS[0]; the server's c and the node's c_i are given (gradient units)
    scenario = _linear_scenario()
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config={"scenario-json": json.dumps(scenario.to_dict())})
    c, c_i = np.array([0.3, -0.2]), np.array([-0.1, 0.4])
    context.state[CONTROL_KEY] = ArrayRecord({"c": _array(LR * c_i)})  # kept in step units, lr * c_i
    x1 = W0.copy()
    dy1, dc1, c_i1 = _reference_client(x1, 0, c, c_i)
    x2 = x1 + np.array([0.05, -0.1])
    dy2, dc2, _ = _reference_client(x2, 0, c, c_i1)  # round 2 starts from the c_i round 1 left

    # Execute: two rounds through the ClientApp, the same node state
    replies = [app(_train_message(x, LR * c, r), context) for r, x in ((1, x1), (2, x2))]

    # Assert: each reply is [y_i - x, lr (c_i+ - c_i)]; the state holds lr c_i+
    for reply, dy, dc in zip(replies, (dy1, dy2), (dc1, dc2), strict=True):
        update = parse_train_reply(reply.content, 4, 1 << 20).delta
        np.testing.assert_allclose(update[:2], dy, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(update[2:], LR * dc, rtol=1e-5, atol=1e-7)
    kept = context.state[CONTROL_KEY]
    assert isinstance(kept, ArrayRecord)
    np.testing.assert_allclose(kept["c"].numpy(), LR * (c_i1 + dc2), rtol=1e-5, atol=1e-7)


def _array(values: np.ndarray) -> Array:
    return Array(values.astype(np.float32))


@pytest.mark.usefixtures("flower_identity")
def test_a_round_without_a_control_variate_trains_and_answers_as_fedavg() -> None:
    scenario = _linear_scenario()
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 2},
                      state=RecordDict(), run_config={"scenario-json": json.dumps(scenario.to_dict())})
    config = TrainConfig(round=1, epochs=1, batch_size=2, lr=LR, seed=1, steps=K)
    message = Message(train_instruction(W0.astype(np.float32), config), 7, "train", group_id="1")
    message.metadata.__dict__["_message_id"] = "train-1"
    update = parse_train_reply(app(message, context).content, 2, 1 << 20).delta
    dy, _, _ = _reference_client(W0, 0, np.zeros(2), np.zeros(2))
    np.testing.assert_allclose(update, dy, rtol=1e-5)
    assert CONTROL_KEY not in context.state


# -- the whole loop ------------------------------------------------------------------------------------------


def test_two_rounds_in_process_match_the_paper_worked_out_in_numpy(db_url: str) -> None:
    # Prepare: N = 3 clients, every one sampled; round 2 needs each node's c_i from round 1, which the
    # in-process engine's workers must hand back in the node's state
    x, c = W0.copy(), np.zeros(2)
    own = [np.zeros(2) for _ in ROWS]
    for _ in range(2):
        answers = [_reference_client(x, i, c, own[i]) for i in range(3)]
        own = [answer[2] for answer in answers]
        x = x + np.mean([a[0] for a in answers], axis=0)
        c = c + 3 / 3 * np.mean([a[1] for a in answers], axis=0)

    # Execute
    summary = simulate(_linear_scenario(clients=3, rounds=2), db_url=db_url)

    # Assert
    state = RunStore(db_url).load_state(summary.run_id)
    assert summary.status == "finished" and state is not None
    np.testing.assert_allclose(state.params, x, rtol=1e-5)
    np.testing.assert_allclose(state.slots["c"], LR * c, rtol=1e-5, atol=1e-7)


def test_under_secure_aggregation_the_sum_gives_the_same_rounds(db_url: str) -> None:
    # Prepare: the masked vector is [dy, lr dc]; the protocol sums it on its fixed-point grid
    secagg = {"enabled": True, "clip_range": 4.0, "threat_model": "semi-honest", "max_weight": 1.0}

    # Execute
    plain = simulate(_linear_scenario(clients=3, rounds=2), db_url=db_url)
    masked = simulate(_linear_scenario(clients=3, rounds=2, secagg=secagg), db_url=db_url)

    # Assert: the same model and control variate, up to the grid's rounding
    store = RunStore(db_url)
    want, got = store.load_state(plain.run_id), store.load_state(masked.run_id)
    assert masked.status == "finished" and want is not None and got is not None
    np.testing.assert_allclose(got.params, want.params, atol=1e-4)
    np.testing.assert_allclose(got.slots["c"], want.slots["c"], atol=1e-4)
    assert np.abs(want.slots["c"]).max() > 1e-3


def _synthetic(strategy: str) -> Scenario:
    return scenario_from_dict({
        "name": f"synthetic-{strategy}", "seed": 7, "rounds": 10,
        "data": {"dataset": "synthetic", "synthetic_alpha": 1.0, "synthetic_beta": 1.0,
                 "client_test_fraction": 0.1, "server_test_fraction": 0.0},
        "model": {"name": "logreg"},
        "federation": {"clients": 10, "clients_per_round": 5, "min_clients": 1, "weighting": "uniform"},
        "training": {"local_steps": 20, "batch_size": 10, "lr": 0.01},
        "strategy": {"name": strategy},
        "evaluation": {"federated": True, "server": False, "clients": "all", "every": 10},
    }, source=strategy)


def test_scaffold_beats_fedavgs_training_loss_on_synthetic_1_1(db_url: str) -> None:
    # Prepare: FedProx's Synthetic(1,1) (Li et al., MLSys 2020), 10 devices, 5 a round, 20 local steps
    # of batch 10 at lr 0.01, the same seed: the same data, samples and shuffles in both runs

    # Execute
    fedavg = simulate(_synthetic("fedavg"), db_url=db_url)
    scaffold = simulate(_synthetic("scaffold"), db_url=db_url)

    # Assert: after 10 rounds the training loss over every device (seed 7: about 0.50 against 0.80)
    assert fedavg.status == scaffold.status == "finished"
    assert fedavg.final_train_loss is not None and scaffold.final_train_loss is not None
    assert scaffold.final_train_loss < 0.8 * fedavg.final_train_loss


# -- what it does not combine with ---------------------------------------------------------------------------


@pytest.mark.parametrize(("sections", "named"), [
    ({"dp": {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 1.0}}, "[dp] enabled = true"),
    ({"dp": {"local_dp_sgd": True}}, "dp.local_dp_sgd = true"),
    ({"compression": {"topk": 0.1}}, "[compression] compresses the uplink"),
    ({"compression": {"bits": 8}}, "[compression] compresses the uplink"),
    ({"faults": {"byzantine": {"fraction": 0.25, "attack": "signflip"}}}, "faults.byzantine"),
])
def test_refused_combinations_name_both_keys(sections: dict[str, Any], named: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        tiny_scenario(strategy={"name": "scaffold"}, **sections)
    assert f"tiny: strategy.name = 'scaffold': {named}" in str(caught.value)


def test_async_refuses_scaffold_naming_both_keys() -> None:
    with pytest.raises(ScenarioError, match=r"async.enabled = True: strategy.name = 'scaffold'"):
        tiny_scenario(strategy={"name": "scaffold"}, evaluation={"federated": False},
                      **{"async": {"enabled": True, "concurrency": 4, "buffer_size": 2}})


def test_downlink_compression_and_secure_aggregation_compose() -> None:
    assert tiny_scenario(strategy={"name": "scaffold"}, compression={"downlink_bits": 16}).compression.downlink_bits
    assert tiny_scenario(strategy={"name": "scaffold"}, secagg={"enabled": True}).secagg.enabled


def test_the_data_parallel_mode_refuses_scaffold() -> None:
    with pytest.raises(ParallelError, match="strategy.name = 'scaffold'"):
        check_scenario(tiny_scenario(strategy={"name": "scaffold"}), Mode.LOCALSGD, 2)
