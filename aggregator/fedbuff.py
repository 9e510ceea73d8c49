"""Buffered asynchronous aggregation (FedBuff) on a virtual clock.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
AISTATS 2022. No round barrier: ``concurrency`` clients train at all times.
Each reply's delta is discounted by ``staleness_weight(s)`` (``s``: server
steps since the model version the client trained on) and folded, as it
arrives, into a buffer through the strategy's aggregation monoid, weighted by
its count policy (1 each under ``uniform``); after ``buffer_size`` replies the
buffer's mean, ``sum c_i a(s_i) delta_i / sum c_i`` (FedBuff's
``(1/K) sum a(s_i) delta_i`` with equal counts), is applied with the server
optimiser (FedAvg, FedAvgM, FedAdam, FedYogi): one *step*, committed like a
round (checkpoint, clients, their versions, staleness, discount and weight). A
buffer of stale replies therefore takes a shorter step. A reply staler than
``max_staleness`` is rejected with the reason, and its client rejoins the idle
queue.

Time is simulated, training is real. The in-process grid answers a dispatch
at once (the client trains on the model it was sent); the reply's *arrival*
is scheduled at ``dispatch time + the client's training time`` on a virtual
clock (:class:`DeviceSpeeds`), and replies are processed in virtual-time
order. Every step records its virtual time (``virtual-time-s``). The same speeds give the synchronous loop's
round times (:meth:`DeviceSpeeds.sync_round_time`), so the two compare on one
timeline (``bench/async.py``).

A resumed run restarts from its last committed step with every client idle,
its clock and dispatch counters restored: replies in flight at the kill are
never folded, so none is counted twice.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid

from aggregator.evaluation import ServerEvaluator, task_round_metrics
from aggregator.step import advance, round_codec, train_config
from core.aggregate import step_problem
from core.errors import UpdateRejected
from core.instructions import COHORT, broadcast_of, train_instruction
from core.layouts import ParamLayout
from core.outcomes import error_outcome
from core.records import ClientRecord, RoundRecord
from core.replies import parse_train_reply
from core.status import ClientStatus, RoundStatus, RunStatus
from core.strategy import ServerState, Strategy, round_rng
from core.weighting import WeightPolicy
from core.wire import wire_bytes
from runstore.runlog import RunLog
from scenarios.schema import Scenario
from scenarios.sections import AsyncSpec

__all__ = ["DeviceSpeeds", "BufferedLoop", "staleness_weight"]

_CLOCK_KEY = "async"  # ServerState.wrapper_state: the virtual time of the last committed step (JSON)


def staleness_weight(staleness: int, rule: str = "sqrt") -> float:
    """FedBuff's discount of a reply ``staleness`` server steps old: ``1 / sqrt(1 + s)`` (or 1)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return 1.0 / math.sqrt(1.0 + staleness) if rule == "sqrt" else 1.0


@dataclass(frozen=True)
class DeviceSpeeds:
    """Each client's training time on the virtual clock, a pure function of (seed, node, dispatch).

    A client's speed factor is lognormal (median 1, ``speed_sigma``); a
    ``stragglers`` fraction of the clients (chosen by the seed) is
    ``straggler_factor`` times slower. One dispatch takes ``base_time_s x
    epochs x factor x`` a lognormal jitter (``jitter_sigma``).
    """

    spec: AsyncSpec
    seed: int
    nodes: tuple[int, ...]
    epochs: int = 1
    factors: dict[int, float] = field(default_factory=dict, compare=False)
    stragglers: set[int] = field(default_factory=set, compare=False)  # the nodes ``straggler_factor`` slower

    def __post_init__(self) -> None:
        """Draw each node's speed factor and the stragglers from the seed."""
        rng = np.random.default_rng([self.seed, 0xA5])
        ordered = sorted(self.nodes)
        base = rng.lognormal(0.0, self.spec.speed_sigma, len(ordered))
        slow = rng.permutation(len(ordered))[:int(round(self.spec.stragglers * len(ordered)))]
        self.stragglers.update(ordered[i] for i in slow.tolist())
        self.factors.update({n: float(base[i] * (self.spec.straggler_factor if n in self.stragglers else 1.0))
                             for i, n in enumerate(ordered)})

    def duration(self, node: int, dispatch: int) -> float:
        """Virtual seconds ``node`` trains on its ``dispatch``-th model."""
        jitter = np.random.default_rng([self.seed, 0xA6, node, dispatch]).lognormal(0.0, self.spec.jitter_sigma)
        return self.spec.base_time_s * self.epochs * self.factors[node] * float(jitter)

    def sync_round_time(self, nodes: Sequence[int], server_round: int, deadline_s: float | None = None) -> float:
        """Return a synchronous round's virtual length: its slowest sampled client, or the deadline."""
        slowest = max(self.duration(n, server_round) for n in nodes) if nodes else 0.0
        return slowest if deadline_s is None else min(slowest, deadline_s)


@dataclass(order=True)
class _InFlight:
    arrival: float
    seq: int
    node: int = field(compare=False)
    version: int = field(compare=False)
    params: np.ndarray = field(compare=False, repr=False)
    reply: Message | None = field(compare=False, repr=False)
    dispatched: float = field(compare=False)


@dataclass
class BufferedLoop:
    """Runs FedBuff steps ``state.round + 1 .. scenario.rounds`` for one stored run on a virtual clock."""

    scenario: Scenario
    strategy: Strategy[Any]
    runlog: RunLog  # the stored run it logs and commits to (runstore.runlog)
    server_eval: ServerEvaluator | None = None
    on_round: Callable[[RoundRecord], None] | None = None
    layout: ParamLayout | None = None
    weighting: WeightPolicy = field(default_factory=WeightPolicy)
    failure: str | None = None  # why the loop gave up (status "failed"), for the run row

    def run(self, grid: Grid, state: ServerState) -> tuple[ServerState, str, RoundRecord | None]:
        """Run buffered steps until ``scenario.rounds``, committing each step to the store.

        Keeps ``async.concurrency`` clients training, folds each reply with its
        staleness discount, and takes a server step every ``async.buffer_size``
        folded updates. Returns the last state, the status (``finished``, or
        ``failed`` when it stopped short of ``scenario.rounds``) and the last
        step's record.
        """
        spec = self.scenario.asynchronous
        nodes = sorted(grid.get_node_ids())
        rng = np.random.default_rng([self.scenario.seed, 0xB0, state.round])
        # a permutation of positions: numpy would turn 64-bit node ids (a SuperLink's) into floats
        idle = [int(nodes[i]) for i in rng.permutation(len(nodes))]
        out, now = self._dispatcher(grid, tuple(nodes), json.loads(state.wrapper_state.get(_CLOCK_KEY, "{}")))
        size = state.params.size
        agg = self.strategy.new_aggregate(size)
        folded: list[ClientRecord] = []
        last: RoundRecord | None = None
        bytes_in = 0
        step_started, t0 = time.time(), time.monotonic()
        while idle and out.in_flight < spec.concurrency:
            out.send(idle.pop(0), now, state)
        futile, limit = 0, max(20, 5 * spec.concurrency)  # replies in a row that could not be folded
        while state.round < self.scenario.rounds and out.in_flight:
            item = out.pop()
            now = item.arrival
            record, nbytes, delta = self._fold(item, state.round - item.version, size,
                                               self.scenario.federation.max_update_ratio, out.time_key)
            bytes_in += nbytes
            if delta is not None and record.metrics is not None:
                discounted = (delta * np.float32(record.metrics["discount"])).astype(np.float32, copy=False)
                agg = self.strategy.accumulate(agg, discounted, float(record.metrics["weight"]), checked=True)
                futile = 0
            else:
                futile += 1
            folded.append(record)
            if futile >= limit:
                self._give_up(futile, folded, state.round + 1)
                break
            idle.append(item.node)
            if agg.count >= spec.buffer_size:  # the step first: the clients dispatched next get its model
                state, last = self._step(state, agg, folded, now, out, step_started, t0, bytes_in)
                agg, folded, bytes_in = self.strategy.new_aggregate(size), [], 0
                step_started, t0 = time.time(), time.monotonic()
            while idle and out.in_flight < spec.concurrency and state.round < self.scenario.rounds:
                out.send(idle.pop(0), out.now(now), state)
        status = RunStatus.FINISHED if state.round >= self.scenario.rounds else RunStatus.FAILED
        return state, status, last

    def _dispatcher(self, grid: Grid, nodes: tuple[int, ...], clock: dict[str, Any]) -> tuple[_Dispatcher, float]:
        """Return the dispatcher of ``async.clock`` and the time the loop starts at (a resumed run's last step's)."""
        spec = self.scenario.asynchronous
        if spec.clock == "wall":
            out: _Dispatcher = _WallDispatcher(self, grid, nodes, clock)
        else:
            out = _Dispatcher(self, grid, nodes, clock,
                              DeviceSpeeds(spec, self.scenario.seed, nodes, self.scenario.training.local_epochs))
        return out, out.start(float(clock.get(out.time_key.replace("-", "_"), 0.0)))

    def _give_up(self, futile: int, folded: list[ClientRecord], step: int) -> None:
        reasons = Counter(c.reason for c in folded if c.outcome != ClientStatus.OK)
        self.failure = (f"{futile} replies in a row could not be folded (most common: "
                        f"{reasons.most_common(1)[0][0]}); stopped before step {step}")
        self.runlog.log(self.failure, "error")

    def _fold(self, item: _InFlight, staleness: int, size: int, ratio: float,
              time_key: str = "virtual-time-s") -> tuple[ClientRecord, int, np.ndarray | None]:
        """Validate one arrived reply: its record, its bytes, and (``ok``) its delta for the buffer."""
        spec = self.scenario.asynchronous
        base = {"version": item.version, "staleness": staleness,
                time_key.replace("-time-", "-duration-"): item.arrival - item.dispatched}
        label = str(item.node)
        if item.reply is None:
            return ClientRecord(client=label, outcome=ClientStatus.DROPPED, stage="train", reason="no reply",
                                metrics=base), 0, None
        if item.reply.has_error():  # a node that is gone (dropped), or a task that raised (failed)
            outcome, reason = error_outcome(item.reply.error)
            return ClientRecord(client=label, outcome=outcome, stage="train", reason=reason, metrics=base), 0, None
        nbytes = wire_bytes(item.reply.content)
        if staleness > spec.max_staleness:
            why = f"staleness {staleness} exceeds async.max_staleness = {spec.max_staleness}"
            return ClientRecord(client=label, outcome=ClientStatus.REJECTED, stage="train", bytes_in=nbytes,
                                metrics=base, reason=why), nbytes, None
        try:
            parsed = parse_train_reply(item.reply.content, size, int(self.scenario.federation.max_update_mb * 2**20),
                                       reference=item.params, layout=self.layout,
                                       codec=round_codec(self.scenario, item.version + 1))
            norm = float(np.linalg.norm(parsed.delta))
            limit = ratio * max(1.0, float(np.linalg.norm(item.params)))
            if not norm <= limit:
                raise UpdateRejected(f"update norm {norm:.4g} exceeds the bound {limit:.4g} "
                                     "(max_update_ratio x model norm)")
        except UpdateRejected as exc:
            return ClientRecord(client=label, outcome=ClientStatus.REJECTED, stage="train", reason=str(exc),
                                bytes_in=nbytes, metrics=base), nbytes, None
        # A count policy that needs the round's median has no round here: such updates weigh 1.
        weight = self.weighting.weight(parsed.num_examples) if self.weighting.streams else 1.0
        discount = staleness_weight(staleness, spec.staleness)
        loss = parsed.metrics.get("train-loss")
        return ClientRecord(client=label, outcome=ClientStatus.OK, num_examples=parsed.num_examples, bytes_in=nbytes,
                            train_loss=float(loss) if isinstance(loss, (int, float)) else None,
                            metrics={**base, "weight": weight, "discount": discount}), nbytes, parsed.delta

    def _step(self, state: ServerState, agg: Any, folded: list[ClientRecord], now: float, out: _Dispatcher,
              started: float, t0: float, bytes_in: int) -> tuple[ServerState, RoundRecord]:
        """Apply the full buffer as one server step, evaluate, and commit it like a round."""
        in_flight, bytes_out, counters = out.in_flight, out.take_bytes_out(), out.counters()
        step = state.round + 1
        strategy = self.strategy.for_round(state)
        new, status = advance(strategy, state, agg, min_clients=1, server_round=step,
                              mean_of=lambda a: strategy.finalize(a, round_rng(strategy, self.scenario.seed, step)))
        problem = step_problem(state.params, new.params, self.scenario.federation.max_update_ratio)
        if problem is not None:
            self.runlog.log(f"step {step}: aggregate rejected: {problem}; model unchanged", "warning")
            new, status = replace(state, round=step), RoundStatus.REJECTED
        clock = {out.time_key.replace("-", "_"): now, **counters}
        new = replace(new, wrapper_state={**new.wrapper_state, _CLOCK_KEY: json.dumps(clock)})
        ok = [c for c in folded if c.outcome == ClientStatus.OK]
        stale = [int(c.metrics["staleness"]) for c in ok if c.metrics]
        losses = [c.train_loss for c in ok if c.train_loss is not None]
        srv_loss = srv_acc = None
        task_metrics: dict[str, float] = {}
        ev = self.scenario.evaluation
        if ev.server and self.server_eval is not None and (step % ev.every == 0 or step == self.scenario.rounds):
            scores = self.server_eval.score(new.params)
            srv_loss, srv_acc, task_metrics = scores["loss"], scores.get("accuracy"), task_round_metrics(scores)
        record = RoundRecord(
            round=step, started_at=started, duration_s=time.monotonic() - t0, sampled=len(folded), clients=folded,
            train_loss=float(np.mean(losses)) if losses else None, server_loss=srv_loss, server_accuracy=srv_acc,
            bytes_in=bytes_in, bytes_out=bytes_out,
            metrics={"status": status, out.time_key: now,
                     "staleness-mean": float(np.mean(stale)) if stale else 0.0, "staleness-max": max(stale, default=0),
                     "staleness-counts": np.bincount(stale).tolist() if stale else [], "in-flight": in_flight,
                     **task_metrics, **({"reason": problem} if problem is not None else {})})
        self.runlog.commit(record, new)
        if self.on_round is not None:
            self.on_round(record)
        return new, record


class _Dispatcher:
    """Sends models to clients and keeps what is in flight, ordered by virtual arrival.

    The in-process grid answers at once; the reply is held until its arrival
    time (dispatch time + the device's duration). The counters (``seq``, each
    node's dispatches) survive a resume in the checkpoint (``counters``).
    """

    time_key = "virtual-time-s"  # the step metric (and checkpointed clock) this dispatcher's time goes under

    def __init__(self, loop: BufferedLoop, grid: Grid, nodes: tuple[int, ...], clock: dict[str, Any],
                 speeds: DeviceSpeeds | None = None) -> None:
        self.loop, self.grid, self.speeds = loop, grid, speeds
        self.flight: list[_InFlight] = []
        self.dispatches = {n: int(clock.get("dispatches", {}).get(str(n), 0)) for n in nodes}
        self.seq = int(clock.get("seq", 0))
        self.bytes_out = 0

    def start(self, resumed_at: float) -> float:
        """Return the loop's time when it starts (a resumed run goes on from its last step's)."""
        return resumed_at

    @property
    def in_flight(self) -> int:
        return len(self.flight)

    def now(self, last_event: float) -> float:
        """Return the time a dispatch happens at: the virtual clock stands at the last event."""
        return last_event

    def pop(self) -> _InFlight:
        """Return the next reply to arrive, in virtual-time order."""
        return heapq.heappop(self.flight)

    def _message(self, node: int, state: ServerState) -> tuple[Message, np.ndarray]:
        """Return the train message for ``node`` with the model of ``state``, and the model the client decodes."""
        scenario, fed = self.loop.scenario, self.loop.scenario.federation
        # A fresh seed per dispatch: a client sent the same version twice must not repeat its shuffle.
        seed = int(np.random.SeedSequence([scenario.seed, state.round, self.seq]).generate_state(
            1, np.uint64)[0] >> np.uint64(1))
        config = replace(train_config(scenario, self.loop.strategy, state.round + 1), seed=seed)
        config = config.with_settings({COHORT: scenario.asynchronous.buffer_size})  # the updates one step folds
        content = train_instruction(state.params, config, self.loop.layout)
        self.bytes_out += wire_bytes(content)
        # what the client decodes (the broadcast's precision): its delta is relative to this
        sent = broadcast_of(config).roundtrip(state.params, self.loop.layout or ParamLayout.flat(state.params.size))
        self.dispatches[node] += 1
        return Message(content, node, "train", ttl=fed.deadline_s, group_id=str(state.round + 1)), sent

    def send(self, node: int, at: float, state: ServerState) -> None:
        """Send ``node`` the model of ``state`` at virtual time ``at``; schedule its reply."""
        if self.speeds is None:
            raise ValueError("the virtual clock needs the devices' speeds")
        message, sent = self._message(node, state)
        replies = list(self.grid.send_and_receive([message], timeout=self.loop.scenario.federation.deadline_s))
        arrival = at + self.speeds.duration(node, self.dispatches[node])
        heapq.heappush(self.flight, _InFlight(arrival, self.seq, node, state.round, sent,
                                              replies[0] if replies else None, at))
        self.seq += 1

    def take_bytes_out(self) -> int:
        """Bytes sent since the last call."""
        sent, self.bytes_out = self.bytes_out, 0
        return sent

    def counters(self) -> dict[str, object]:
        return {"seq": self.seq, "dispatches": {str(n): k for n, k in self.dispatches.items()}}


class _WallDispatcher(_Dispatcher):
    """Real time (``async.clock = "wall"``, a deployment).

    Messages are pushed as clients go idle and replies pulled as they come, in
    arrival order; a message unanswered after ``federation.deadline_s`` comes
    back as a dropped reply, and its client rejoins the idle queue.
    """

    time_key = "wall-time-s"
    POLL_S = 0.05

    def __init__(self, loop: BufferedLoop, grid: Grid, nodes: tuple[int, ...], clock: dict[str, Any],
                 monotonic: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(loop, grid, nodes, clock)
        self.pending: dict[str, _InFlight] = {}  # message id -> the dispatch (arrival: its deadline)
        self.arrived: list[_InFlight] = []
        self.abandoned: set[str] = set()  # past their deadline: a late reply is pulled (freed) and discarded
        self.refused: list[_InFlight] = []  # pushes the link refused: dropped at their deadline, not at once
        self._monotonic, self._sleep, self._origin = monotonic, sleep, monotonic()

    def start(self, resumed_at: float) -> float:
        self._origin = self._monotonic() - resumed_at  # a resumed run's wall time goes on from its last step
        return resumed_at

    def clock(self) -> float:
        """Seconds of this run's wall time (across resumes)."""
        return self._monotonic() - self._origin

    def now(self, last_event: float) -> float:  # noqa: ARG002 (the virtual clock's signature)
        return self.clock()

    @property
    def in_flight(self) -> int:
        return len(self.pending) + len(self.arrived) + len(self.refused)

    def send(self, node: int, at: float, state: ServerState) -> None:
        message, sent = self._message(node, state)
        item = _InFlight(at + self.loop.scenario.federation.deadline_s, self.seq, node, state.round, sent, None, at)
        self.seq += 1
        ids = [i for i in self.grid.push_messages([message]) if i]
        if not ids:  # refused by the link (a payload too large, say): dropped at the deadline, as if sent and lost,
            self.refused.append(item)  # so the node is not retried in a tight loop
            return
        self.pending[ids[0]] = item

    def pop(self) -> _InFlight:
        """Return the next reply to arrive (waiting for it), or a dispatch whose deadline passed, as dropped."""
        while not self.arrived:
            for reply in self.grid.pull_messages([*self.pending, *self.abandoned]):
                message_id = reply.metadata.reply_to_message_id
                self.abandoned.discard(message_id)
                item = self.pending.pop(message_id, None)
                if item is not None:
                    self.arrived.append(replace(item, arrival=self.clock(), reply=reply))
            now = self.clock()
            for message_id, item in list(self.pending.items()):
                if now >= item.arrival:  # its deadline: the client is dropped, not waited for
                    self.arrived.append(replace(self.pending.pop(message_id), arrival=now))
                    self.abandoned.add(message_id)
            due = [item for item in self.refused if now >= item.arrival]
            self.refused = [item for item in self.refused if now < item.arrival]
            self.arrived.extend(replace(item, arrival=now) for item in due)
            if not self.arrived:
                self._sleep(self.POLL_S)
        return self.arrived.pop(0)
