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

from flwr.app import RecordDict
from flwr.serverapp import Grid

from core.aggregate import MeanState
from core.partials import edge_devices, edge_secured, partial_reply
from core.strategy import Strategy
from core.train import TrainRequest, TrainWorkflow

__all__ = ["edge_round", "EdgeAnswer"]


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

    Raises
    ------
    TypeError
        ``strategy`` folds no running sum (a robust rule; the scenario refuses it under ``[hierarchy]``).
    """
    started = time.monotonic()
    devices = edge_devices(instruction)
    outcome = train(grid, replace(request, nodes=devices), strategy)
    agg = outcome.aggregate
    if agg is not None and not isinstance(agg, MeanState):
        raise TypeError(f"strategy {strategy.name!r} folds no running sum; an edge can send only a sum")
    seconds = time.monotonic() - started
    if agg is None or agg.count == 0:
        return EdgeAnswer(partial_reply(None, 0.0, 0, outcome.clients, seconds))
    if edge_secured(instruction):
        return EdgeAnswer(partial_reply(None, agg.weight, agg.count, outcome.clients, seconds), secret=agg)
    return EdgeAnswer(partial_reply(agg.total, agg.weight, agg.count, outcome.clients, seconds))
