"""Federated evaluation through the edges: each edge asks its own devices and sends their rows up.

The aggregator groups the devices to evaluate by edge, sends each edge the
evaluate instruction with its devices (:func:`core.partials.edge_instruction`)
and reads each device's scores from the edge's answer as it would read the
device's own reply (:func:`core.partials.parse_eval_partial`). The round's
federated scores are then summed from the same rows, in the same order, as a
flat round's (:func:`aggregator.evaluation.summarise`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
from flwr.app import RecordDict
from flwr.serverapp import Grid

from aggregator.evaluation import EvalSummary, summarise
from aggregator.hierarchy.edge import edge_evaluate
from aggregator.hierarchy.fleet import EdgeFleet, FleetTopology
from aggregator.hierarchy.topology import Topology
from aggregator.hierarchy.tree import EDGE_MARGIN_S, MAX_EDGES_AT_ONCE
from core.boundary import one_line
from core.errors import UpdateRejected
from core.instructions import TrainConfig, evaluate_instruction
from core.layouts import ParamLayout
from core.partials import EDGE_EVALUATE, edge_instruction, parse_eval_partial
from core.status import ClientStatus
from core.wire import wire_bytes

__all__ = ["TreeEvaluate"]


@dataclass
class TreeEvaluate:
    """Evaluate through ``edges`` edge aggregators (``[hierarchy] edges``): an :data:`EvaluateWorkflow`."""

    edges: int
    _topology: Topology | None = field(default=None, init=False, repr=False)

    def __call__(self, grid: Grid, nodes: Sequence[int], params: np.ndarray, config: TrainConfig,
                 deadline_s: float, layout: ParamLayout | None = None) -> EvalSummary:
        """Ask each edge with devices among ``nodes`` to evaluate ``params``; the round's scores from their rows."""
        topology: Topology | FleetTopology
        if isinstance(grid, EdgeFleet):  # a deployment: the tree as its edges last described it
            topology = grid.topology()
        else:
            if self._topology is None:
                self._topology = Topology.blocks(self.edges, grid.get_node_ids())
            topology = self._topology
        content = evaluate_instruction(params, config, layout)
        orders = [(edge, devices, edge_instruction(content, devices)) for edge, devices in topology.groups(nodes)]
        rows = _Rows()
        if isinstance(grid, EdgeFleet):
            answers = grid.ask_edges(EDGE_EVALUATE, [(edge, message) for edge, _, message in orders],
                                     deadline_s + EDGE_MARGIN_S)
            for (edge, devices, message), answer in zip(orders, answers, strict=True):
                rows.bytes_out += wire_bytes(message)
                rows.edge(edge, devices, _done(answer))
            return rows.summary()
        at_once = MAX_EDGES_AT_ONCE if getattr(grid, "thread_safe", False) else 1
        with ThreadPoolExecutor(max_workers=max(1, min(at_once, len(orders))),
                                thread_name_prefix="quorum-edge") as pool:
            futures = [pool.submit(edge_evaluate, grid, message, params, config, deadline_s, layout)
                       for _, _, message in orders]
            for (edge, devices, message), future in zip(orders, futures, strict=True):
                rows.bytes_out += wire_bytes(message)
                rows.edge(edge, devices, future)
        return rows.summary()


def _done(answer: RecordDict | Exception) -> Future[RecordDict]:
    future: Future[RecordDict] = Future()
    if isinstance(answer, Exception):
        future.set_exception(answer)
    else:
        future.set_result(answer)
    return future


@dataclass
class _Rows:
    """The devices' scores as the edges' answers carry them, in the order a flat round pulls them."""

    results: dict[int, tuple[float | None, float | None, int]] = field(default_factory=dict)
    named: dict[int, dict[str, int | float]] = field(default_factory=dict)
    train: dict[int, tuple[float, int]] = field(default_factory=dict)
    lost: dict[int, tuple[str, str]] = field(default_factory=dict)  # device -> (outcome, reason)
    bytes_in: int = 0
    bytes_out: int = 0

    def edge(self, edge: int, devices: list[int], future: Future[RecordDict]) -> None:
        """Read ``edge``'s answer for ``devices``; a failed edge or a refused answer loses them all."""
        try:
            reply = future.result()
        except Exception as exc:  # the edge's evaluation itself failed: none of its devices scored
            self.lost.update({d: (ClientStatus.FAILED, f"edge {edge} failed: {one_line(exc)}") for d in devices})
            return
        self.bytes_in += wire_bytes(reply)
        try:
            rows = parse_eval_partial(reply, devices)
        except UpdateRejected as exc:
            self.lost.update({d: (ClientStatus.REJECTED, f"edge {edge}'s evaluation refused: {exc}")
                              for d in devices})
            return
        for device in devices:
            scored = rows.results.get(device)
            if scored is None:
                self.lost[device] = rows.lost.get(device, (ClientStatus.DROPPED, f"edge {edge} did not report it"))
                continue
            self.results[device] = (scored.loss, scored.accuracy, scored.num_examples)
            self.named[device] = scored.metrics
            if scored.train_loss is not None and scored.train_examples > 0:
                self.train[device] = (scored.train_loss, scored.train_examples)

    def summary(self) -> EvalSummary:
        """Return the round's federated scores, summed as a flat round sums them, and why devices are missing."""
        summary = summarise(self.results, self.named, self.train, self.bytes_in, self.bytes_out)
        by = {status: {d: why for d, (outcome, why) in self.lost.items() if outcome == status}
              for status in (ClientStatus.REJECTED, ClientStatus.FAILED, ClientStatus.REFUSED)}
        dropped = tuple(sorted(d for d, (outcome, _) in self.lost.items() if outcome == ClientStatus.DROPPED))
        return replace(summary, per_client_metrics=self.named, rejected=by[ClientStatus.REJECTED],
                       failed=by[ClientStatus.FAILED], refused=by[ClientStatus.REFUSED], dropped=dropped)
