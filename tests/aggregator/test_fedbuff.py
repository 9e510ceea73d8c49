"""Buffered asynchronous aggregation (FedBuff) on the in-process engine's virtual clock."""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from aggregator.fedbuff import BufferedLoop, DeviceSpeeds, staleness_weight
from aggregator.serverapp import run_federation
from clients.clientapp import app as client_app
from core.instructions import TrainConfig, read_instruction
from core.records import RoundRecord
from core.replies import train_reply
from learning.task import TaskModel, load_task
from runstore.runlog import RunLog
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
from scenarios.schema import scenario_from_dict
from scenarios.sections import AsyncSpec
from tests.conftest import tiny_scenario

ASYNC = {"enabled": True, "concurrency": 6, "buffer_size": 3, "stragglers": 0.25, "straggler_factor": 10.0}


def scenario(rounds: int = 10, **spec: object):
    return tiny_scenario(rounds=rounds, federation={"clients": 8, "deadline_s": 60.0},
                         evaluation={"federated": False}, **{"async": {**ASYNC, **spec}})


def test_staleness_discount_is_one_over_root_one_plus_s() -> None:
    assert staleness_weight(0) == 1.0 and staleness_weight(3) == 0.5 and staleness_weight(8) == pytest.approx(1 / 3)
    assert staleness_weight(5, "constant") == 1.0
    with pytest.raises(ValueError, match="staleness"):
        staleness_weight(-1)


def test_device_speeds_are_seeded_and_stragglers_are_factor_times_slower() -> None:
    spec = AsyncSpec(enabled=True, speed_sigma=0.0, jitter_sigma=0.0, stragglers=0.25, straggler_factor=10.0,
                     base_time_s=2.0)
    speeds = DeviceSpeeds(spec, seed=4, nodes=tuple(range(1, 9)), epochs=3)
    again = DeviceSpeeds(spec, seed=4, nodes=tuple(range(1, 9)), epochs=3)
    assert speeds.stragglers == again.stragglers and len(speeds.stragglers) == 2
    for node in range(1, 9):  # base 2 s x 3 epochs, x10 for a straggler
        assert speeds.duration(node, 1) == pytest.approx(60.0 if node in speeds.stragglers else 6.0)
    assert speeds.sync_round_time(range(1, 9), 1) == pytest.approx(60.0)
    assert speeds.sync_round_time(range(1, 9), 1, deadline_s=10.0) == 10.0


def test_fedbuff_steps_without_waiting_for_stragglers_and_discounts_stale_replies(db_url: str) -> None:
    # Execute
    summary = simulate(scenario(), db_url=db_url)

    # Assert: ten steps of exactly three folded replies, on an increasing virtual clock
    store = RunStore(db_url)
    rows = store.rounds(summary.run_id)
    assert summary.status == "finished" and [r.round for r in rows] == list(range(1, 11))
    times = [r.metrics["virtual-time-s"] for r in rows]
    assert times == sorted(times) and times[0] > 0
    replies = [c for r in rows for c in store.client_results(summary.run_id, r.round)]
    assert all(sum(c.outcome == "ok" for c in store.client_results(summary.run_id, r.round)) == 3 for r in rows)
    # every delta is discounted by 1 / sqrt(1 + staleness); the default count policy needs a round's median,
    # which a buffer has not, so every reply weighs 1
    assert all(c.metrics["discount"] == pytest.approx(1 / math.sqrt(1 + c.metrics["staleness"])) for c in replies)
    assert all(c.metrics["weight"] == 1.0 for c in replies)
    assert max(c.metrics["staleness"] for c in replies) >= 2
    # the stragglers (10x slower) fold far less often than the others, and with more staleness
    speeds = DeviceSpeeds(scenario().asynchronous, 3, tuple(range(1, 9)))
    folds = Counter(int(c.client) for c in replies)
    slow, fast = [folds[n] for n in speeds.stragglers], [folds[n] for n in range(1, 9) if n not in speeds.stragglers]
    assert max(slow) < min(fast)
    assert summary.final_accuracy > 0.5


def test_a_reply_staler_than_the_limit_is_rejected_with_the_reason(db_url: str) -> None:
    summary = simulate(scenario(rounds=4, max_staleness=0), db_url=db_url)
    store = RunStore(db_url)
    rejected = [c for r in store.rounds(summary.run_id) for c in store.client_results(summary.run_id, r.round)
                if c.outcome == "rejected"]
    assert summary.status == "degraded" and rejected  # every step ran; refused replies degrade the run
    assert all("exceeds async.max_staleness = 0" in c.reason and c.metrics["staleness"] > 0 for c in rejected)
    ok = [c for r in store.rounds(summary.run_id) for c in store.client_results(summary.run_id, r.round)
          if c.outcome == "ok"]
    assert all(c.metrics["staleness"] == 0 for c in ok)


def test_a_killed_async_run_resumes_from_its_last_step_without_counting_a_reply_twice(db_url: str) -> None:
    # Prepare: the run is interrupted right after step 3 is committed
    def stop_after_three(record: RoundRecord) -> None:
        if record.round == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(scenario(rounds=6), db_url=db_url, on_round=stop_after_three)
    store = RunStore(db_url)
    run_id = store.list_runs()[0].id
    clock_at_kill = store.rounds(run_id)[-1].metrics["virtual-time-s"]

    # Execute
    summary = simulate(scenario(rounds=6), db_url=db_url, resume_id=run_id)

    # Assert: steps 1..6 once each, the clock continues; step 4 folded only replies to models sent after
    # the resume (version 3): the replies in flight at the kill were never folded
    rows = store.rounds(run_id)
    assert summary.status == "finished" and [r.round for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[3].metrics["virtual-time-s"] > clock_at_kill
    after = [c for c in store.client_results(run_id, 4) if c.outcome == "ok"]
    assert len(after) == 3 and all(c.metrics["version"] == 3 for c in after)


def constant_client(message: Message, context: Context) -> Message:
    """Every client sends the same delta, 0.01 on every coordinate."""
    instruction = read_instruction(message.content)
    delta = np.full(instruction.params.size, 0.01, dtype=np.float32)
    return Message(train_reply(delta, 10, {"train-loss": 1.0}, answer_to=instruction), reply_to=message)


@pytest.mark.parametrize("rule", ["sqrt", "constant"])
def test_each_step_applies_the_mean_of_the_discounted_deltas(db_url: str, rule: str) -> None:
    # Prepare: 6 clients sending the constant delta d = 0.01, 4 in flight, a step every 2 replies
    spec = tiny_scenario(rounds=6, federation={"clients": 6, "deadline_s": 60.0, "weighting": "uniform"},
                         evaluation={"federated": False, "server": False},
                         **{"async": {"enabled": True, "concurrency": 4, "buffer_size": 2, "staleness": rule,
                                      "stragglers": 0.34, "straggler_factor": 5.0}})
    nodes = [NodeSpec(i + 1, {"partition-id": i, "num-partitions": 6}) for i in range(6)]
    store = RunStore(db_url)

    # Execute
    with InProcessGrid(constant_client, nodes, {}) as grid:
        run_id, result = run_federation(grid, spec, store, engine="inprocess")

    # Assert: FedAvg's step (server_lr 1) is (1/K) sum a(s_i) d: worked out from the recorded staleness
    # (steps 2..6, each against the state committed with the step before)
    assert result.status == "finished"
    previous, staler = None, 0  # the step from the initial model is checked against step 1's state
    for step in range(1, 7):
        now = store.load_state(run_id, step).params
        folded = [c for c in store.client_results(run_id, step) if c.outcome == "ok"]
        alphas = [1 / math.sqrt(1 + c.metrics["staleness"]) if rule == "sqrt" else 1.0 for c in folded]
        if previous is not None:
            np.testing.assert_allclose(now - previous, 0.01 * np.mean(alphas), rtol=1e-4)
        staler += sum(c.metrics["staleness"] > 0 for c in folded)
        previous = now
    assert staler > 0  # some steps were made of stale replies, which a sqrt discount shortens


@pytest.mark.parametrize(("extra", "match"), [
    ({"secagg": {"enabled": True}}, r"async.enabled = True: \[secagg\] enabled = true"),
    ({"dp": {"enabled": True, "noise_multiplier": 1.0}}, r"async.enabled = True: \[dp\] enabled = true"),
    ({"strategy": {"name": "median"}}, r"async.enabled = True: strategy.name = 'median'"),
    ({"faults": {"dropouts": {"train": 0.3}}}, r"async.enabled = True: faults.dropouts"),
    ({"evaluation": {"federated": True}}, r"async.enabled = True: evaluation.federated = true"),
])
def test_what_the_async_mode_does_not_combine_with_is_refused_naming_both_keys(extra: dict, match: str) -> None:
    with pytest.raises(ScenarioError, match=match):
        tiny_scenario(federation={"clients": 8}, **{"evaluation": {"federated": False}, "async": ASYNC, **extra})


def test_async_settings_are_validated_and_survive_a_round_trip() -> None:
    with pytest.raises(ScenarioError, match=r"async.buffer_size = 7: exceeds async.concurrency = 6"):
        scenario(buffer_size=7)
    with pytest.raises(ScenarioError, match=r"async.stragglers = 1.0"):
        scenario(stragglers=1.0)
    spec = scenario()
    assert "async" in spec.to_dict() and "asynchronous" not in spec.to_dict()
    assert scenario_from_dict(spec.to_dict(), source="again") == spec


def test_the_async_mode_refuses_an_engine_without_a_virtual_clock(db_url: str) -> None:
    with pytest.raises(ScenarioError, match='set async.clock = "wall"'):
        run_federation(object(), scenario(), RunStore(db_url), engine="flower")  # type: ignore[arg-type]
    with pytest.raises(ScenarioError, match="not engine 'ray'"):
        simulate(scenario(), db_url=db_url, engine="ray")
    assert RunStore(db_url).list_runs() == []  # refused before a run row exists


def test_an_async_run_in_which_no_reply_can_be_folded_fails_with_the_reason(db_url: str) -> None:
    # Prepare: every update is longer than the (absurdly small) bound, so none can be folded
    spec = tiny_scenario(rounds=3, federation={"clients": 8, "deadline_s": 60.0, "max_update_ratio": 1e-9},
                         evaluation={"federated": False}, **{"async": ASYNC})

    # Execute
    summary = simulate(spec, db_url=db_url)

    # Assert: it stopped (no endless re-dispatching), failed, and says why
    run = RunStore(db_url).get_run(summary.run_id)
    assert run.status == "failed" and run.rounds_done == 0
    assert "could not be folded" in run.error and "exceeds the bound" in run.error


class SlowNodeGrid(InProcessGrid):
    """The in-process grid, with one node's replies held back ``delay_s`` seconds of wall time."""

    def __init__(self, *args, slow: int, delay_s: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slow, self.delay_s = slow, delay_s

    def push_messages(self, messages):
        batch = list(messages)
        ids = list(super().push_messages(batch))
        for message_id, message in zip(ids, batch, strict=True):
            if message.metadata.dst_node_id == self.slow:
                self._ready_at[message_id] = time.monotonic() + self.delay_s
        return ids


def _warm_up(spec) -> None:
    model = TaskModel.build(load_task(spec), spec.seed)
    model.train(model.task.partition(0).train, TrainConfig(round=1, epochs=1, batch_size=16, lr=0.1, momentum=0.0,
                                                           seed=0), seed=0)


def test_wall_clock_mode_steps_while_a_slow_client_trains_and_folds_its_stale_reply(db_url: str) -> None:
    # Prepare: 3 clients, all in flight, a step every 2 replies; node 3 answers 0.6 s late in wall time
    spec = tiny_scenario(rounds=30, federation={"clients": 3, "deadline_s": 30.0}, evaluation={"federated": False},
                         **{"async": {"enabled": True, "clock": "wall", "concurrency": 3, "buffer_size": 2}})
    nodes = [NodeSpec(i + 1, {"partition-id": i, "num-partitions": 3}) for i in range(3)]
    run_config = {"scenario-json": json.dumps(spec.to_dict())}
    _warm_up(spec)  # the process's first training imports torch's compiler stack (2-3 s), longer than the delay
    with SlowNodeGrid(client_app, nodes, run_config, slow=3, delay_s=0.6) as grid:
        # Execute
        run_id, result = run_federation(grid, spec, RunStore(db_url), engine="inprocess")

    # Assert: steps were taken before the slow client's first reply arrived; that reply was folded
    # later, stale, with the discount 1 / sqrt(1 + s); every step records wall time and staleness counts
    store = RunStore(db_url)
    rows = store.rounds(run_id)
    assert result.status == "finished" and len(rows) == 30
    replies = [(r.round, c) for r in rows for c in store.client_results(run_id, r.round) if c.outcome == "ok"]
    slow = [(step, c) for step, c in replies if c.client == "3"]
    first_slow_step = slow[0][0]
    assert first_slow_step >= 2  # at least one step applied while node 3 was still training
    stale = slow[0][1].metrics
    assert stale["staleness"] >= 1 and stale["discount"] == pytest.approx(1 / math.sqrt(1 + stale["staleness"]))
    assert stale["wall-duration-s"] >= 0.6
    times = [r.metrics["wall-time-s"] for r in rows]
    assert times == sorted(times) and all("virtual-time-s" not in r.metrics for r in rows)
    for r in rows:
        counts = r.metrics["staleness-counts"]
        folded = [c for c in store.client_results(run_id, r.round) if c.outcome == "ok"]
        assert sum(counts) == len(folded) == 2
        assert counts == np.bincount([int(c.metrics["staleness"]) for c in folded]).tolist()


def test_wall_clock_refuses_the_virtual_clocks_device_speeds() -> None:
    with pytest.raises(ScenarioError, match=r"async.stragglers = 0.25: simulates slow devices"):
        scenario(clock="wall")


def _wall(rounds: int, deadline: float = 30.0, **spec: object):
    return tiny_scenario(rounds=rounds, federation={"clients": 3, "deadline_s": deadline},
                         evaluation={"federated": False},
                         **{"async": {"enabled": True, "clock": "wall", "concurrency": 3, "buffer_size": 2, **spec}})


def _nodes() -> list[NodeSpec]:
    return [NodeSpec(i + 1, {"partition-id": i, "num-partitions": 3}) for i in range(3)]


def test_wall_clock_drops_a_client_past_the_deadline_and_goes_on(db_url: str) -> None:
    # Prepare: node 3 always answers 3 s late, past the 2 s deadline
    spec = _wall(8, deadline=2.0)
    with SlowNodeGrid(client_app, _nodes(), {"scenario-json": json.dumps(spec.to_dict())}, slow=3,
                      delay_s=3.0) as grid:
        # Execute
        run_id, result = run_federation(grid, spec, RunStore(db_url), engine="inprocess")

    # Assert: node 3 is recorded dropped at its deadline and never folded; the run went on without it
    store = RunStore(db_url)
    records = [c for r in store.rounds(run_id) for c in store.client_results(run_id, r.round)]
    assert result.status == "finished" and len(store.rounds(run_id)) == 8
    assert {(c.outcome, c.reason) for c in records if c.client == "3"} <= {("dropped", "no reply")}


class ScriptedGrid:
    """A grid whose replies the test hands over one by one (``answer``), on a clock the test moves."""

    def __init__(self) -> None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # as a grid stamps messages
        self.pushed: list[str] = []
        self.ready: list[Message] = []
        self.pulled: list[list[str]] = []

    def push_messages(self, messages):
        ids = [f"m{len(self.pushed) + i}" for i, _ in enumerate(list(messages))]
        self.pushed.extend(ids)
        return ids

    def answer(self, message_id: str) -> None:
        self.ready.append(Message(RecordDict(), reply_to=_sent(message_id)))

    def pull_messages(self, message_ids):
        wanted = set(message_ids)
        self.pulled.append(sorted(wanted))
        out = [m for m in self.ready if m.metadata.reply_to_message_id in wanted]
        self.ready = [m for m in self.ready if m not in out]
        return out


def _sent(message_id: str) -> Message:
    message = Message(RecordDict(), dst_node_id=3, message_type="train")
    message.metadata.__dict__["_message_id"] = message_id
    return message


def test_the_wall_dispatcher_drops_at_the_deadline_and_discards_the_late_reply(db_url: str) -> None:
    # Prepare: a dispatcher on a fake clock; node 3 is sent the model at t = 0 (deadline 2 s)
    from aggregator.fedbuff import _WallDispatcher
    from aggregator.serverapp import build_strategy
    from core.strategy import ServerState

    spec = _wall(2, deadline=2.0)
    now = {"t": 0.0}
    loop = BufferedLoop(scenario=spec, strategy=build_strategy(spec), runlog=RunLog(RunStore(db_url), "r"))
    grid = ScriptedGrid()
    out = _WallDispatcher(loop, grid, (1, 2, 3), {}, monotonic=lambda: now["t"],
                          sleep=lambda s: now.__setitem__("t", now["t"] + s))
    state = ServerState(params=np.zeros(650, np.float32), round=0)
    out.send(3, 0.0, state)
    # Execute: nothing comes back; the clock passes the deadline while pop waits
    dropped = out.pop()
    out.send(1, out.clock(), state)
    grid.answer("m0")  # node 3's late reply
    grid.answer("m1")  # node 1's
    arrived = out.pop()
    # Assert: the late reply was pulled (freed) and discarded; node 1's came back
    assert dropped.node == 3 and dropped.reply is None and dropped.arrival >= 2.0
    assert arrived.node == 1 and arrived.reply is not None
    assert out.abandoned == set() and out.in_flight == 0 and grid.ready == []


class RefusingGrid(InProcessGrid):
    """A link that refuses every message to node 3 (as a SuperLink refuses a payload too large)."""

    def push_messages(self, messages):
        batch = list(messages)
        kept = [m for m in batch if m.metadata.dst_node_id != 3]
        ids = iter(super().push_messages(kept))
        return [next(ids) if m.metadata.dst_node_id != 3 else None for m in batch]


def test_wall_clock_takes_a_refused_push_as_a_dropped_reply(db_url: str) -> None:
    spec = _wall(3, deadline=1.0)
    with RefusingGrid(client_app, _nodes(), {"scenario-json": json.dumps(spec.to_dict())}) as grid:
        run_id, result = run_federation(grid, spec, RunStore(db_url), engine="inprocess")
    store = RunStore(db_url)
    records = [c for r in store.rounds(run_id) for c in store.client_results(run_id, r.round)]
    # not retried in a tight loop (which would end the run "failed": 20 replies in a row not folded)
    assert result.status == "finished" and len(store.rounds(run_id)) == 3
    assert {c.outcome for c in records if c.client == "3"} <= {"dropped"}


def test_a_resumed_wall_clock_run_goes_on_from_its_last_steps_time(db_url: str) -> None:
    # Prepare: stopped after step 2
    def stop_after_two(record: RoundRecord) -> None:
        if record.round == 2:
            raise KeyboardInterrupt

    spec = _wall(4)
    with pytest.raises(KeyboardInterrupt):
        simulate(spec, db_url=db_url, on_round=stop_after_two)
    store = RunStore(db_url)
    run_id = store.list_runs()[0].id
    # Execute
    simulate(spec, db_url=db_url, resume_id=run_id)
    # Assert: the wall time never goes back across the resume
    times = [r.metrics["wall-time-s"] for r in store.rounds(run_id)]
    assert len(times) == 4 and times == sorted(times)
