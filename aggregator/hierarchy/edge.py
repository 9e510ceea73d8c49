"""An edge aggregator's part of a round: train the devices it was asked for, answer with one partial sum.

Towards its devices an edge is an aggregator: it runs the round's train
workflow (plain, or secure aggregation inside its cohort, so the edge learns
only its devices' sum) over the devices the aggregator sampled under it.
Towards the aggregator it is one client: it answers with the weighted sum of
what it folded, their weight and count, and a row per device
(:func:`core.partials.partial_reply`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from flwr.app import RecordDict
from flwr.serverapp import Grid

from aggregator.evaluation import federated_evaluate
from aggregator.hierarchy.robust import as_partial_sum
from core.aggregate import MeanState
from core.buffer import UpdateBuffer
from core.instructions import TrainConfig
from core.layouts import ParamLayout
from core.partials import edge_devices, edge_secured, eval_partial_reply, partial_reply
from core.status import ClientStatus
from core.strategy import Strategy
from core.train import TrainRequest, TrainWorkflow

__all__ = ["edge_round", "edge_evaluate", "EdgeAnswer"]


@dataclass(frozen=True)
class EdgeAnswer:
    """What an edge sends: its reply, and (asked for a secure sum across the edges) its sum, for the protocol only."""

    reply: RecordDict
    secret: MeanState | None = None


def edge_round(grid: Grid, instruction: RecordDict, request: TrainRequest, train: TrainWorkflow,
               strategy: Strategy[Any]) -> EdgeAnswer:
    """Run an edge's sub-round for ``instruction`` (:func:`core.partials.edge_instruction`) over ``grid``.

    ``request`` is the round's train request (its nodes are replaced by the
    devices the instruction names); ``train`` the workflow the edge runs its
    devices with. Returns the edge's reply; when the instruction asks for a
    secure sum across the edges, the reply carries no sum and the answer's
    ``secret`` holds it, to be masked in that protocol (``aggregator.hierarchy.secure``).

    ``strategy`` is what the edge folds its devices with: the round's, or a
    robust rule (``aggregator.hierarchy.robust``), whose aggregate of the
    cohort then goes up as a sum.

    Raises
    ------
    TypeError
        ``strategy`` keeps an aggregate that is neither a running sum nor a robust rule's buffer.
    """
    started = time.monotonic()
    devices = edge_devices(instruction)
    outcome = train(grid, replace(request, nodes=devices), strategy)
    agg = outcome.aggregate
    if isinstance(agg, UpdateBuffer):  # a robust rule at the edge: its aggregate of the cohort, as a sum
        agg = as_partial_sum(strategy, agg, request.state.params.dtype.name) if agg.count else None
    if agg is not None and not isinstance(agg, MeanState):
        raise TypeError(f"strategy {strategy.name!r} folds no running sum; an edge can send only a sum")
    seconds = time.monotonic() - started
    if agg is None or agg.count == 0:
        return EdgeAnswer(partial_reply(None, 0.0, 0, outcome.clients, seconds))
    if edge_secured(instruction):
        return EdgeAnswer(partial_reply(None, agg.weight, agg.count, outcome.clients, seconds), secret=agg)
    return EdgeAnswer(partial_reply(agg.total, agg.weight, agg.count, outcome.clients, seconds))


def edge_evaluate(grid: Grid, instruction: RecordDict, params: np.ndarray, config: TrainConfig, deadline_s: float,
                  layout: ParamLayout | None = None) -> RecordDict:
    """Run an edge's part of a federated evaluation: ask its devices the instruction names, answer with their rows.

    Each device's scores travel up as its own evaluate reply carried them
    (:func:`core.partials.eval_partial_reply`); a device whose evaluation is
    missing, with why (dropped, rejected, failed, refused).
    """
    devices = edge_devices(instruction)
    summary = federated_evaluate(grid, devices, params, config, deadline_s, layout)
    lost = {node: (ClientStatus.DROPPED, "no evaluation reply within the round's deadline") for node in summary.dropped}
    lost.update({node: (ClientStatus.REJECTED, why) for node, why in summary.rejected.items()})
    lost.update({node: (ClientStatus.FAILED, why) for node, why in summary.failed.items()})
    lost.update({node: (ClientStatus.REFUSED, why) for node, why in summary.refused.items()})
    return eval_partial_reply(summary.per_client, summary.per_client_metrics, summary.per_client_train,
                              {node: (str(outcome), why) for node, (outcome, why) in lost.items()})
