"""The Flower mod and workflow over an in-process Grid: same sums, same dropout recovery."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

with warnings.catch_warnings():  # flwr's CLI dependencies warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    import flwr  # noqa: F401

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from privacy.secagg import SecAggAborted, SecAggConfig, Stage
from privacy.secagg.codec import decode, encode
from privacy.secagg.flower_mod import secagg_mod
from privacy.secagg.flower_workflow import run_secagg
from privacy.secagg.identity import node_config
from privacy.secagg.messages import MaskedInputRequest
from runtimes.faults import FaultPlan
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.syncgrid import SyncGrid

NODES = list(range(101, 109))
rng0 = np.random.default_rng(7)
UPDATES = {u: rng0.uniform(-1, 1, 30).astype(np.float32) for u in NODES}
EXAMPLES = {u: int(rng0.integers(1, 50)) for u in NODES}
# t = 3 of 8 is no strict majority: the semi-honest model, on the server and on every node.
CONFIG = SecAggConfig(threshold=3, max_weight=50.0, stage_timeout_s=5.0, threat_model="semi-honest")
SEMI_NODES = {u: {"secagg-threat-model": "semi-honest"} for u in NODES}
# The default, actively secure model: t = 5 of 8, identities enrolled per node.
MALICIOUS = SecAggConfig(max_weight=50.0, stage_timeout_s=5.0)
MODEL = RecordDict({"model": ArrayRecord({"w": Array(np.zeros(30, np.float32))})})


def make_app(failing: frozenset[int] = frozenset()) -> ClientApp:
    app = ClientApp()

    @app.train(mods=[secagg_mod])
    def train(message: Message, context: Context) -> Message:
        node = message.metadata.dst_node_id
        if node in failing:
            raise RuntimeError("training crashed")
        return Message(RecordDict({
            "update": ArrayRecord({"delta": Array(UPDATES[node])}),
            "metrics": MetricRecord({"num-examples": EXAMPLES[node], "train-loss": 0.5}),
        }), reply_to=message)

    return app


class Grid(SyncGrid):
    """A SyncGrid whose nodes accept semi-honest rounds unless given other node configs."""

    def __init__(self, app, node_ids, drop=lambda _: False, node_configs=None):
        super().__init__(app, node_ids, drop, node_configs=SEMI_NODES if node_configs is None else node_configs)


def stage_of(message: Message) -> str | None:
    record = message.content.config_records.get("secagg")
    return None if record is None else str(record["stage"])


def dropping(stage: Stage, nodes: set[int]):
    return lambda m: stage_of(m) == stage.value and m.metadata.dst_node_id in nodes


def plain(survivors):
    total = sum(EXAMPLES[u] * UPDATES[u].astype(np.float64) for u in survivors)
    return total, sum(EXAMPLES[u] for u in survivors)


def run(grid, config=CONFIG, **kw):
    return run_secagg(grid, NODES, MODEL, config, server_round=3, rng=np.random.default_rng(0), **kw)


@pytest.mark.parametrize("stage", list(Stage))
def test_flower_round_recovers_from_dropouts_at_each_stage(stage):
    # Prepare: the default model, every node enrolled (simulation enrolment)
    grid = Grid(make_app(), NODES, dropping(stage, {102, 105}), node_configs=node_config(NODES))

    # Execute
    result = run(grid, MALICIOUS)

    # Assert
    in_sum = set(NODES) - ({102, 105} if stage not in (Stage.CONSISTENCY_CHECK, Stage.UNMASK) else set())
    assert [s.stage for s in result.stages] == list(Stage)
    total, weight = plain(in_sum)
    assert set(result.survivors) == in_sum
    assert np.abs(result.total - total).max() <= result.error_bound
    assert abs(result.total_weight - weight) <= result.error_bound
    assert set(result.client_metrics) == in_sum
    assert result.client_metrics[101] == {"num-examples": EXAMPLES[101], "train-loss": 0.5}


def test_without_client_metrics_the_server_gets_the_sum_and_nothing_per_client():
    # Prepare: spy on every reply that reaches the server
    grid = Grid(make_app(), NODES, dropping(Stage.MASKED_INPUT, {104}))
    replies: list[Message] = []
    pull = grid.pull_messages
    grid.pull_messages = lambda ids: [replies.append(r) or r for r in pull(ids)]  # type: ignore[method-assign]
    # Execute
    result = run(grid, dataclasses.replace(CONFIG, client_metrics=False))
    # Assert: the same weighted sum as plain FedAvg, and no metrics in any reply or in the result
    total, weight = plain(set(NODES) - {104})
    assert np.abs(result.total - total).max() <= result.error_bound
    assert abs(result.total_weight - weight) <= result.error_bound
    assert result.client_metrics == {}
    masked = [r for r in replies if stage_of(r) == Stage.MASKED_INPUT.value]
    assert len(masked) == len(NODES) - 1
    assert all("metrics" not in r.content.metric_records for r in replies)


def test_every_stage_message_names_its_stage():
    seen: list[tuple[str | None, str]] = []
    grid = Grid(make_app(), NODES, lambda m: seen.append((stage_of(m), m.metadata.message_type)) and False)

    run(grid)

    assert [s for s, _ in seen[::len(NODES)]] == [s.value for s in Stage if s is not Stage.CONSISTENCY_CHECK]
    assert {t for _, t in seen} == {"train"}


def test_a_node_refuses_a_semi_honest_round_unless_its_own_config_allows_it():
    # Prepare: nodes with no secure-aggregation node config (policy: malicious)
    grid = Grid(make_app(), NODES, node_configs={})

    # Execute / Assert: every node refuses the downgraded round at once
    with pytest.raises(SecAggAborted, match=r"stage 'advertise_keys': 0 of 8"):
        run(grid)


def test_a_silent_node_is_dropped_at_the_deadline():
    class PlainGrid(Grid):
        """A grid that cannot tell whether a node is gone: only the deadline helps."""

        def __getattribute__(self, name):
            if name == "settled":
                raise AttributeError(name)
            return super().__getattribute__(name)

    now = {"t": 0.0}
    grid = PlainGrid(make_app(), NODES, dropping(Stage.SHARE_KEYS, {104}))

    # an injected clock: each of the workflow's waits advances fake time by 1 s, nothing sleeps
    result = run(grid, clock=lambda: now["t"], sleep=lambda _: now.__setitem__("t", now["t"] + 1.0))

    assert 104 not in result.survivors
    share_keys = result.stages[1]
    assert share_keys.seconds >= CONFIG.stage_timeout_s
    assert len(share_keys.completed) == len(NODES) - 1


def test_a_crashing_trainer_is_a_dropout():
    result = run(Grid(make_app(failing=frozenset({106})), NODES))

    assert 106 not in result.survivors
    assert np.abs(result.total - plain(result.survivors)[0]).max() <= result.error_bound


class TamperingGrid(Grid):
    """Flips one bit of the first share relayed to ``victim`` at MASKED_INPUT."""

    victim = 103

    def push_messages(self, messages):
        out = []
        for m in messages:
            if stage_of(m) == Stage.MASKED_INPUT.value and m.metadata.dst_node_id == self.victim:
                header = m.content.config_records["secagg"]
                request = decode(header["payload"], MaskedInputRequest)
                first = request.shares[0]
                bad = dataclasses.replace(first, ciphertext=bytes([first.ciphertext[0] ^ 1]) + first.ciphertext[1:])
                header["payload"] = encode(MaskedInputRequest((bad,) + request.shares[1:]))
            out.append(m)
        return super().push_messages(out)


def test_a_tampered_share_makes_its_receiver_refuse_and_the_round_goes_on():
    result = run(TamperingGrid(make_app(), NODES))

    assert TamperingGrid.victim not in result.survivors
    assert np.abs(result.total - plain(result.survivors)[0]).max() <= result.error_bound


def test_too_few_survivors_aborts_naming_the_stage():
    grid = Grid(make_app(), NODES, dropping(Stage.MASKED_INPUT, set(NODES[:6])))

    with pytest.raises(SecAggAborted, match=r"stage 'masked_input': 2 of 8 sampled clients survived, threshold is 3"):
        run(grid)


def test_messages_without_secagg_pass_through_the_mod():
    grid = Grid(make_app(), NODES)
    message = Message(RecordDict({"config": ConfigRecord({"lr": 0.1})}), dst_node_id=101, message_type="train")

    reply = grid.pull_messages(grid.push_messages([message]))[0]

    assert reply.content.array_records["update"]["delta"].numpy().shape == (30,)


def test_round_over_the_platforms_threaded_grid_with_its_fault_injector():
    plan = FaultPlan(seed=1, dropouts={Stage.MASKED_INPUT.value: 0.25})

    with InProcessGrid(make_app(), [NodeSpec(u, SEMI_NODES[u]) for u in NODES], {}, plan) as grid:
        result = run(grid)

    assert len(result.survivors) == len(NODES) - 2
    assert np.abs(result.total - plain(result.survivors)[0]).max() <= result.error_bound


@pytest.mark.parametrize("dtype", ["<u4", "<u8", "<f4", ">i8"])
def test_fast_array_conversions_match_flowers_own(dtype):
    from privacy.secagg.flower_records import array_of, ndarray_of

    vector = np.arange(1000).astype(dtype)

    assert array_of(vector).data == Array(vector).data
    assert np.array_equal(ndarray_of(Array(vector)), vector)
    assert ndarray_of(Array(vector)).dtype == np.dtype(dtype)
    assert np.array_equal(ndarray_of(Array(np.ones((2, 3)))), np.ones((2, 3)))
