"""One untrusted client must not take over, corrupt or fail a run (issue 12, "Why").

Clients here are scripted: each answers with a fixed delta and example count
(no training), so the aggregate of every round is worked out by hand.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from aggregator.rounds import RoundLoop
from aggregator.serverapp import final_status, run_federation
from aggregator.strategies import FedAvg
from core import aggregate
from core.errors import StoreError
from core.eval_replies import eval_reply
from core.instructions import parse_instruction
from core.records import RoundRecord
from core.replies import train_reply
from core.strategy import ServerState
from core.train import TrainOutcome, TrainRequest
from runstore.runlog import RunLog
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from tests.aggregator.test_rounds import initial_params
from tests.conftest import tiny_scenario

Behaviour = Callable[[str, int, int, np.ndarray], RecordDict]
NO_EVAL = {"federated": False, "server": False}


def scripted(behaviour: Behaviour) -> Callable[[Message, object], Message]:
    def app(message: Message, context) -> Message:
        params, _ = parse_instruction(message.content)
        content = behaviour(message.metadata.message_type, context.node_id, int(message.metadata.group_id), params)
        return Message(content, reply_to=message)
    return app


def honest(node: int, params: np.ndarray) -> RecordDict:
    """Node k moves every parameter by 0.001 k, on 100 examples."""
    return train_reply(np.full(params.size, 0.001 * node, np.float32), 100, {"train-loss": 0.5})


def run(scenario, behaviour: Behaviour, db_url: str):
    store = RunStore(db_url)
    nodes = [NodeSpec(i + 1, {}) for i in range(scenario.federation.clients)]
    with InProcessGrid(scripted(behaviour), nodes, {}) as grid:
        run_id, result = run_federation(grid, scenario, store, engine="inprocess")
    return store, run_id, result


def attacked_by_node_4(reply: Callable[[np.ndarray], RecordDict]) -> Behaviour:
    def behaviour(kind: str, node: int, round_: int, params: np.ndarray) -> RecordDict:
        if kind == "evaluate":
            return eval_reply(0.5, 0.5, 10)
        return reply(params) if node == 4 else honest(node, params)
    return behaviour


def test_an_inflated_example_count_is_capped_at_three_times_the_median(db_url: str) -> None:
    # Prepare: node 4 claims 10**9 examples (the most a reply may claim) with a reversed update.
    # Median of (100, 100, 100, 10**9) = 100, cap 300: mean = (100 (.001 + .002 + .003) - 300 x .01) / 600
    scenario = tiny_scenario(rounds=1, evaluation=NO_EVAL)
    attack = attacked_by_node_4(lambda p: train_reply(np.full(p.size, -0.01, np.float32), 10**9, {}))
    # Execute
    store, run_id, result = run(scenario, attack, db_url)
    # Assert
    np.testing.assert_allclose(store.load_state(run_id).params, initial_params(scenario) - 0.004, atol=1e-7)
    assert result.status == "finished"


def test_capped_policy_uses_the_declared_maximum(db_url: str) -> None:
    # max_examples = 200: weights (100, 100, 100, 200): mean = (0.6 - 200 x 0.01) / 500 = -0.0028
    scenario = tiny_scenario(rounds=1, evaluation=NO_EVAL,
                             federation={"weighting": "capped", "max_examples": 200})
    attack = attacked_by_node_4(lambda p: train_reply(np.full(p.size, -0.01, np.float32), 10**9, {}))
    store, run_id, _ = run(scenario, attack, db_url)
    np.testing.assert_allclose(store.load_state(run_id).params, initial_params(scenario) - 0.0028, atol=1e-7)


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (lambda p: train_reply(np.full(p.size, -0.01, np.float32), 10**12, {}), "num-examples must be an integer"),
        (lambda p: train_reply(np.full(p.size, -0.01, np.float32), 2**63, {}), "num-examples must be an integer"),
        (lambda p: train_reply(np.full(p.size, -0.01, np.float32), 10**39, {}), "num-examples must be an integer"),
        (lambda p: train_reply(np.full(p.size, -0.01, np.float32), 2**62, {}), "num-examples must be an integer"),
        (lambda _: RecordDict({"update": ConfigRecord({"delta": 1.0}), "metrics": MetricRecord({"num-examples": 9})}),
         "'update' is a ConfigRecord"),
        (lambda _: RecordDict({"update": MetricRecord({"delta": 1.0}), "metrics": MetricRecord({"num-examples": 9})}),
         "'update' is a MetricRecord"),
        (lambda p: train_reply(np.full(p.size, 3e38, np.float32), 100, {}), "update norm inf exceeds the bound"),
    ],
    ids=["count-1e12", "count-2^63", "count-1e39", "count-2^62", "config-record", "metric-record", "3e38-values"],
)
def test_a_malformed_reply_is_rejected_and_the_run_goes_on(db_url: str, reply, reason: str) -> None:
    # Prepare: the honest mean is (0.001 + 0.002 + 0.003) / 3 = 0.002 per parameter
    scenario = tiny_scenario(rounds=1, evaluation=NO_EVAL)
    # Execute
    store, run_id, result = run(scenario, attacked_by_node_4(reply), db_url)
    # Assert
    rejected = [c for c in store.client_results(run_id) if c.outcome == "rejected"]
    assert [(c.client, reason in c.reason) for c in rejected] == [("4", True)]
    params = store.load_state(run_id).params
    assert np.isfinite(params).all()
    np.testing.assert_allclose(params, initial_params(scenario) + 0.002, atol=1e-7)
    assert (result.status, store.get_run(run_id).status) == ("degraded", "degraded")  # it ran, with a refusal
    assert store.get_run(run_id).error.startswith("client 4 rejected in 1 of 1 rounds")


def test_an_eval_accuracy_of_a_million_is_not_stored(db_url: str) -> None:
    # Prepare: three clients score 0.5, node 4 claims 1e6
    def behaviour(kind: str, node: int, round_: int, params: np.ndarray) -> RecordDict:
        if kind == "evaluate":
            return eval_reply(0.5, 1e6 if node == 4 else 0.5, 10)
        return honest(node, params)
    scenario = tiny_scenario(rounds=1, evaluation={"federated": True, "server": False})
    # Execute
    store, run_id, _ = run(scenario, behaviour, db_url)
    # Assert
    assert store.rounds(run_id)[0].fed_accuracy == 0.5


def test_a_run_in_which_every_client_speaks_another_layout_fails_with_the_reason(db_url: str) -> None:
    # Prepare: every reply lacks the 'metrics' record, so every round is skipped
    scenario = tiny_scenario(rounds=2, evaluation=NO_EVAL)
    # Execute
    store, run_id, result = run(scenario, lambda *_: RecordDict({"other": MetricRecord({"x": 1})}), db_url)
    # Assert
    run_row = store.get_run(run_id)
    assert (result.status, run_row.status) == ("failed", "failed")
    assert run_row.error.startswith("no round changed the model: all 2 rounds skipped or rejected (round 2 skipped")
    assert [r.metrics["status"] for r in store.rounds(run_id)] == ["skipped", "skipped"]


def test_a_run_with_some_rounds_skipped_ends_degraded_with_the_count(db_url: str) -> None:
    def behaviour(kind: str, node: int, round_: int, params: np.ndarray) -> RecordDict:
        return RecordDict({"other": MetricRecord({"x": 1})}) if round_ == 1 else honest(node, params)
    scenario = tiny_scenario(rounds=2, evaluation=NO_EVAL)
    store, run_id, result = run(scenario, behaviour, db_url)
    run_row = store.get_run(run_id)
    assert (result.status, run_row.status) == ("degraded", "degraded")
    assert run_row.error.startswith("1 of 2 rounds skipped or rejected (round 1 skipped")
    # round 2 alone moved the model: four honest nodes, (0.001 + 0.002 + 0.003 + 0.004) / 4
    np.testing.assert_allclose(store.load_state(run_id).params, initial_params(scenario) + 0.0025, atol=1e-7)


class FixedAggregate:
    """A train workflow whose aggregate is given: what an overflowing or exploding sum looks like."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, grid, request: TrainRequest, strategy) -> TrainOutcome:  # noqa: ARG002 (TrainWorkflow's)
        total = np.full(request.state.params.size, self.value, np.float32)
        return TrainOutcome(aggregate=aggregate.MeanState(total=total, weight=1.0, count=4))


@pytest.mark.parametrize(("value", "reason"), [(np.inf, "holds NaN or Inf"), (np.nan, "holds NaN or Inf"),
                                               (1e6, "over the bound")])
def test_a_non_finite_or_exploding_aggregate_rejects_the_round(db_url: str, value: float, reason: str) -> None:
    # Prepare
    scenario = tiny_scenario(rounds=2, evaluation=NO_EVAL)
    store = RunStore(db_url)
    start = initial_params(scenario)
    run_id = store.create_run(name="guard", scenario=scenario.to_dict(), seed=0, strategy="fedavg", rounds=2)
    with InProcessGrid(scripted(lambda *_: RecordDict()), [NodeSpec(i + 1, {}) for i in range(4)], {}) as grid:
        loop = RoundLoop(scenario=scenario, strategy=FedAvg(), train=FixedAggregate(value),
                         runlog=RunLog(store, run_id))
        # Execute
        result = loop.run(grid, ServerState.initial(start))
    # Assert: the model never moved, each round says why, the run is not "finished"
    np.testing.assert_array_equal(store.load_state(run_id).params, start)
    rounds = store.rounds(run_id)
    assert [r.metrics["status"] for r in rounds] == ["rejected", "rejected"]
    assert all(reason in r.metrics["reason"] for r in rounds)
    assert sum("aggregate rejected" in e.message for e in store.events(run_id)) == 2
    status, error = final_status(store, run_id, result.status)
    assert status == "failed" and reason in error


def test_an_error_after_the_run_row_exists_marks_it_failed(db_url: str) -> None:
    # Prepare: something breaks right after the run row is created
    def boom(run_id: str) -> None:
        raise RuntimeError("the display broke")
    store = RunStore(db_url)
    scenario = tiny_scenario(rounds=1, evaluation=NO_EVAL)
    # Execute
    with (InProcessGrid(scripted(lambda *_: RecordDict()), [NodeSpec(i + 1, {}) for i in range(4)], {}) as grid,
          pytest.raises(RuntimeError, match="the display broke")):
        run_federation(grid, scenario, store, engine="inprocess", on_start=boom)
    # Assert
    (row,) = store.list_runs()
    assert (row.status, row.error) == ("failed", "RuntimeError: the display broke")


def test_the_store_refuses_a_non_finite_checkpoint(db_url: str) -> None:
    store = RunStore(db_url)
    run_id = store.create_run(name="x", scenario={}, seed=0, strategy="fedavg", rounds=1)
    state = ServerState(params=np.array([0.0, np.nan], np.float32), round=1)
    with pytest.raises(StoreError, match="params hold NaN or Inf"):
        store.commit_round(run_id, RoundRecord(round=1, started_at=0.0, duration_s=0.0, sampled=0, clients=[]), state)
    assert store.rounds(run_id) == []
