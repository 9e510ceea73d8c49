"""The aggregator's train step over a tree: each edge trains its sampled devices, the edges' sums are merged.

Same shape as :class:`aggregator.train.PlainTrain`: (sampled devices, global
model) in, a running aggregate and one record per device out. The round's
devices are sampled as in a flat run; :class:`TreeTrain` groups them by edge
(:class:`~aggregator.hierarchy.topology.Topology`), sends each edge that has
any the round's instruction with its devices (:func:`core.partials.edge_instruction`),
and merges the partial sums the edges answer, in edge order, into the
strategy's running mean. FedAvg over the edges' sums is then flat FedAvg over
their devices: with ``[federation] accumulate = "float64"`` the two models
agree to float32's rounding of each edge's sum.

An edge's reply is checked as a client's would be (:func:`core.partials.parse_partial_reply`)
and more: its weight must be what its own rows' example counts give under the
round's weighting, and its mean update must be within ``max_update_ratio`` of
the model, which every device's update was. A refused edge's devices are
recorded ``rejected``, with the reason; one bad edge never kills a round.

In simulation the edges run here, on threads, over the in-process grid (one
edge at a time on a grid that is not thread-safe, Ray's); in a deployment each
edge is an aggregator of its own (``docs/hierarchy.md``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import RecordDict
from flwr.serverapp import Grid

from aggregator.hierarchy.edge import EdgeAnswer, edge_round
from aggregator.hierarchy.fleet import EdgeFleet, FleetTopology
from aggregator.hierarchy.robust import edge_strategy
from aggregator.hierarchy.secure import secure_edge_sum
from aggregator.hierarchy.topology import Topology
from core import aggregate
from core.aggregate import MeanState
from core.boundary import one_line
from core.errors import EdgeUnavailable, UpdateRejected
from core.instructions import train_instruction
from core.partials import EDGE_TRAIN, PartialReply, edge_instruction, parse_partial_reply
from core.records import ClientRecord
from core.status import ClientStatus
from core.strategy import PrivateStrategy, Strategy
from core.train import TrainOutcome, TrainRequest, TrainWorkflow
from core.weighting import WeightPolicy
from core.wire import wire_bytes
from privacy.secagg.errors import SecAggAborted, SecAggConfigError
from scenarios.threats import SecAggSpec

__all__ = ["TreeTrain", "EDGE_MARGIN_S"]
#: Edges whose sub-rounds run at once in simulation: two keep the worker pool busy while one edge waits on its
#: last device; more only add threads polling the grid (measured at 2,000 devices under 20 edges: 16 at once
#: took 5-6 s a round, 1 or 2 at once 3.4-4 s).
MAX_EDGES_AT_ONCE = 2
#: How much longer than a round's deadline the aggregator waits for a deployed edge: the edge's own
#: sub-round has the deadline, and its answer still has to come up (a second or two on a SuperLink).
EDGE_MARGIN_S = 10.0


@dataclass
class TreeTrain:
    """Train through edge aggregators: ``edge`` runs each edge's devices, and the edges' sums are merged.

    Parameters
    ----------
    edge : TrainWorkflow
        What an edge runs over its devices: plain training, or secure aggregation inside its cohort.
    edges : int
        How many edge aggregators the federation's devices are split over (``[hierarchy] edges``).
    weighting : WeightPolicy
        The round's weighting, which each edge's weight is checked against (a streaming rule:
        the scenario refuses ``median`` under ``[hierarchy]``); ``None`` skips that check (secure
        aggregation weighs on its own quantised grid).
    max_update_ratio : float
        An edge's mean update longer than ``max_update_ratio * max(1, |model|)`` is refused.
    accumulate : str
        What the merged sum accumulates in (``[federation] accumulate``).
    secure_across : SecAggSpec | None
        Sum the edges' sums by secure aggregation too, with these settings
        (``[hierarchy] secure_across_edges``): the aggregator learns only the global sum.
    unit_weights : bool
        Every device weighs 1 whatever its example count (DP-FedAvg, ``[dp]``, or a
        robust rule at the edges): an edge's weight must then be its count of devices folded. ``weighting``
        still weighs the devices' training losses, as a flat round does.
    """

    edge: TrainWorkflow
    edges: int
    weighting: WeightPolicy | None = None
    max_update_ratio: float = 10.0
    accumulate: str = "float32"
    secure_across: SecAggSpec | None = None
    unit_weights: bool = False
    _topology: Topology | None = field(default=None, init=False, repr=False)

    def topology(self, grid: Grid) -> Topology | FleetTopology:
        """Return the tree over ``grid``'s devices.

        In simulation, ``edges`` blocks of the devices (built once: a simulated
        federation's devices do not change); in a deployment, as the edges last
        described it (:class:`~aggregator.hierarchy.fleet.EdgeFleet`).
        """
        if isinstance(grid, EdgeFleet):
            return grid.topology()
        if self._topology is None:
            self._topology = Topology.blocks(self.edges, grid.get_node_ids())
        return self._topology

    def __call__(self, grid: Grid, request: TrainRequest, strategy: Strategy[Any]) -> TrainOutcome[Any]:
        """Run the round's train step through the edges that have sampled devices, and merge their sums."""
        topology = self.topology(grid)
        groups = topology.groups(request.nodes)
        content = train_instruction(request.state.params, request.config, request.layout)
        secure = self.secure_across is not None
        instructions = [(edge, devices, edge_instruction(content, devices, secure)) for edge, devices in groups]
        size = strategy.new_aggregate(request.state.params.size).size
        merge = _Merge(self, request, size, strategy, names=getattr(topology, "names", ()))
        if isinstance(grid, EdgeFleet):  # a deployment: the edges are aggregators of their own, asked at once
            if secure:
                raise SecAggConfigError("hierarchy.secure_across_edges", True, "false in a deployment: a secure "
                                        "sum across the edges runs in simulation only (secure aggregation runs "
                                        "inside each deployed edge)")
            started = time.monotonic()
            answers = grid.ask_edges(EDGE_TRAIN, [(edge, message) for edge, _, message in instructions],
                                     request.deadline_s + EDGE_MARGIN_S, request.server_round)
            for (edge, devices, message), answer in zip(instructions, answers, strict=True):
                merge.edge(edge, devices, wire_bytes(message), _settled(answer))
            return merge.outcome(time.monotonic() - started)
        at_once = MAX_EDGES_AT_ONCE if getattr(grid, "thread_safe", False) else 1
        expect = getattr(grid, "expect_cohort", None)  # a simulation's faults: the devices a flat round loses
        if expect is not None:
            expect(request.server_round, "train", list(request.nodes))
        lose = getattr(grid, "lost_edges", None)  # a simulation's edges that vanish ([faults] edges)
        merge.lost = lose(request.server_round, [edge for edge, _ in groups]) if lose is not None else frozenset()
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=max(1, min(at_once, len(groups))),
                                thread_name_prefix="quorum-edge") as pool:
            futures = [pool.submit(edge_round, grid, message, request, self.edge, edge_strategy(strategy))
                       for _, _, message in instructions]
            for (edge, devices, message), future in zip(instructions, futures, strict=True):
                merge.edge(edge, devices, wire_bytes(message), future)  # in edge order: the same bits every run
        return merge.outcome(time.monotonic() - started)


@dataclass
class _Merge:
    """The aggregator's side of one round: each edge's reply checked, its sum merged, its devices recorded."""

    tree: TreeTrain
    request: TrainRequest
    size: int
    strategy: Strategy[Any]
    agg: MeanState | None = None
    clients: list[ClientRecord] = field(default_factory=list)
    edges: list[dict[str, Any]] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    secured: list[tuple[int, PartialReply, MeanState]] = field(default_factory=list)  # for the secure sum
    lost: frozenset[int] = frozenset()  # edges that vanish this round, in simulation
    names: tuple[str, ...] = ()  # a deployed edge's name, by edge

    def __post_init__(self) -> None:
        empty = self.strategy.new_aggregate(self.request.state.params.size)  # its size: the model, plus a tail
        if not isinstance(empty, MeanState):
            raise TypeError(f"strategy {self.strategy.name!r} folds no running sum; a tree merges edges' sums")
        self.agg = aggregate.widened(empty, self.tree.accumulate)
        norm = float(np.linalg.norm(self.request.state.params))
        self.bound = self.tree.max_update_ratio * max(1.0, norm)

    def edge(self, edge: int, devices: list[int], sent: int, future: Future[EdgeAnswer]) -> None:
        """Wait for ``edge``'s reply to the round's instruction for ``devices`` (``sent`` bytes); merge it.

        Under a secure sum across the edges the edge's sum is kept for that
        protocol (:meth:`outcome`), never read here.
        """
        self.bytes_out += sent
        row: dict[str, Any] = {"edge": edge, "sampled": len(devices), "bytes_down": sent,
                               **({"name": self.names[edge]} if edge < len(self.names) else {})}
        try:
            answer = future.result()
        except EdgeUnavailable as exc:  # a deployed edge that never answered (it died, or its link did)
            self._lost(edge, devices, row, ClientStatus.DROPPED, f"edge {self._name(edge)} dropped: {exc}")
            return
        except Exception as exc:  # the edge's sub-round itself failed: none of its devices counts
            self._lost(edge, devices, row, ClientStatus.FAILED, f"edge {self._name(edge)} failed: {one_line(exc)}")
            return
        if edge in self.lost:  # it vanished after its devices trained: its answer never comes
            self._lost(edge, devices, row, ClientStatus.DROPPED, f"edge {edge} never answered (it vanished after "
                       "its devices trained)")
            return
        nbytes = wire_bytes(answer.reply)
        self.bytes_in += nbytes
        row["bytes_up"] = nbytes
        secure = self.tree.secure_across is not None
        try:
            partial = parse_partial_reply(answer.reply, self.size, self.request.max_update_bytes, devices, secure)
            self._check(partial)
        except UpdateRejected as exc:
            self._lost(edge, devices, row, ClientStatus.REJECTED,
                       f"edge {self._name(edge)}'s partial sum refused: {exc}")
            return
        if partial.total is not None:
            assert self.agg is not None
            self.agg = aggregate.merge(self.agg, MeanState(partial.total, partial.weight, partial.count))
        elif secure and partial.count and answer.secret is not None:
            self.secured.append((edge, partial, answer.secret))
        self._record(edge, devices, partial.devices, row, partial.seconds)

    def _name(self, edge: int) -> str:
        return self.names[edge] if edge < len(self.names) else str(edge)

    def _check(self, partial: PartialReply) -> None:
        """Refuse a sum its own rows do not account for, or whose mean no device's update could give."""
        weighting = self.tree.weighting
        if weighting is not None and partial.count:
            counts = [d.num_examples for d in partial.devices if d.outcome == ClientStatus.OK]
            expected = float(len(counts)) if self.tree.unit_weights else float(sum(weighting.weight(n)
                                                                                   for n in counts))
            if not abs(partial.weight - expected) <= 1e-6 * expected:
                raise UpdateRejected(f"weight {partial.weight:.6g} is not the {expected:.6g} its devices' "
                                     "example counts give")
        if partial.total is not None:
            self._check_mean(partial.total, partial.weight)

    def _check_mean(self, total: np.ndarray, weight: float) -> None:
        with np.errstate(over="ignore"):
            norm = float(np.linalg.norm(total.astype(np.float64))) / weight
        if not norm <= self.bound:
            raise UpdateRejected(f"its mean update has norm {norm:.4g}, over the bound {self.bound:.4g} "
                                 "(max_update_ratio x model norm) that each device's update was held to")

    def _record(self, edge: int, devices: list[int], rows: list[ClientRecord], row: dict[str, Any],
                seconds: float) -> None:
        reported = {r.client for r in rows}
        missing = [ClientRecord(client=str(d), outcome=ClientStatus.DROPPED, stage="train",
                                reason=f"edge {edge} did not report it") for d in devices if str(d) not in reported]
        tagged = [_tagged(r, edge) for r in [*rows, *missing]]
        self.clients.extend(tagged)
        for status in (ClientStatus.OK, ClientStatus.DROPPED, ClientStatus.REJECTED, ClientStatus.FAILED,
                       ClientStatus.REFUSED):
            row[_COUNTS[status]] = sum(1 for r in tagged if r.outcome == status)
        row["seconds"] = round(seconds, 4)
        row["bytes_devices"] = sum(r.bytes_in for r in rows)
        self.edges.append(row)

    def _lost(self, edge: int, devices: list[int], row: dict[str, Any], outcome: ClientStatus, reason: str) -> None:
        self.clients.extend(_tagged(ClientRecord(client=str(d), outcome=outcome, stage="train", reason=reason), edge)
                            for d in devices)
        row.update({_COUNTS[ClientStatus.OK]: 0, _COUNTS[outcome]: len(devices), "problem": reason})
        self.edges.append(row)

    def _secure_sum(self) -> dict[str, Any]:
        """Sum the kept edges' sums by secure aggregation across the edges; merge the result, or lose their devices.

        The sum's weight must be the weights the edges declared in clear (each
        edge's count and weight are no secret: its device rows carry them); the
        global mean is held to the bound each device's update was.
        """
        assert self.tree.secure_across is not None and self.agg is not None
        kept = self.secured
        edges = [edge for edge, _, _ in kept]
        try:
            result = secure_edge_sum([secret for _, _, secret in kept], self.tree.secure_across,
                                     seed=self.request.config.seed, server_round=self.request.server_round)
        except (SecAggAborted, SecAggConfigError) as exc:
            self._unfold(edges, ClientStatus.DROPPED, f"secure aggregation across the edges did not finish: {exc}")
            return {"edges": len(kept), "aborted": one_line(exc)}
        declared = sum(p.weight for _, p, _ in kept)
        survivors = [kept[i] for i in result.survivors]
        try:
            if len(survivors) != len(kept):
                raise UpdateRejected(f"{len(kept) - len(survivors)} edge(s) dropped out of the protocol")
            if not abs(result.total_weight - declared) <= 1e-6 * declared + 2 * result.error_bound:
                raise UpdateRejected(f"its weight {result.total_weight:.6g} is not the {declared:.6g} the edges "
                                     "declared")
            self._check_mean(result.total, result.total_weight)
        except UpdateRejected as exc:
            self._unfold(edges, ClientStatus.REJECTED, f"the secure sum across the edges refused: {exc}")
            return {"edges": len(kept), "refused": str(exc)}
        up, down = sum(s.bytes_up for s in result.stages), sum(s.bytes_down for s in result.stages)
        self.bytes_in, self.bytes_out = self.bytes_in + up, self.bytes_out + down  # the protocol's messages
        total = np.asarray(result.total, dtype=self.agg.total.dtype)
        summed = MeanState(total, float(result.total_weight), sum(p.count for _, p, _ in kept))
        # a private strategy bounds a secure sum's count bit (DP-FedAvg's fold_sum); a plain one merges it
        self.agg = (self.strategy.fold_sum(self.agg, summed) if isinstance(self.strategy, PrivateStrategy)
                    else aggregate.merge(self.agg, summed))
        return {"edges": len(kept), "survivors": len(result.survivors), "error_bound": float(result.error_bound),
                "bytes_up": up, "bytes_down": down}

    def _unfold(self, edges: list[int], outcome: ClientStatus, reason: str) -> None:
        """Mark the ok devices of ``edges`` with ``outcome``: their updates are in no sum the round keeps."""
        lost = set(edges)
        self.clients = [replace(c, outcome=outcome, stage="train", reason=reason)
                        if c.outcome == ClientStatus.OK and c.edge in lost else c
                        for c in self.clients]
        for row in self.edges:
            if row["edge"] in lost:
                row["problem"] = reason

    def outcome(self, seconds: float) -> TrainOutcome[Any]:
        """Return the round's outcome: the merged sum (``None``: nothing folded), every device's record, the tree."""
        secure = self._secure_sum() if self.secured else None
        agg = self.agg if self.agg is not None and self.agg.count else None
        losses = [(r.train_loss, r.num_examples) for r in self.clients
                  if r.outcome == ClientStatus.OK and r.train_loss is not None]
        train_loss = None
        if losses:  # weighted as a flat round weighs them: by the weighting, or by example count
            counts = [n for _, n in losses]
            weights = self.tree.weighting.weights(counts) if self.tree.weighting is not None else counts
            train_loss = float(np.average([loss for loss, _ in losses], weights=weights))
        tree = {"edges": self.edges, "seconds": round(seconds, 4),
                "bytes_devices": sum(r.get("bytes_devices", 0) for r in self.edges),
                **({"secure_across_edges": secure} if secure is not None else {})}
        return TrainOutcome(aggregate=agg, clients=self.clients, bytes_in=self.bytes_in, bytes_out=self.bytes_out,
                            train_loss=train_loss, tree=tree)


def _settled(answer: RecordDict | Exception) -> Future[EdgeAnswer]:
    """Return a deployed edge's answer (or why there is none) as the future a simulated edge's sub-round gives."""
    future: Future[EdgeAnswer] = Future()
    if isinstance(answer, Exception):
        future.set_exception(answer)
    else:
        future.set_result(EdgeAnswer(answer))
    return future


_COUNTS: dict[str, str] = {ClientStatus.OK: "answered", ClientStatus.DROPPED: "dropped",
                           ClientStatus.REJECTED: "rejected", ClientStatus.FAILED: "failed",
                           ClientStatus.REFUSED: "refused"}


def _tagged(record: ClientRecord, edge: int) -> ClientRecord:
    return replace(record, edge=edge)

