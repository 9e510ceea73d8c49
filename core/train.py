"""The train step's types: what a train workflow is asked for and what it returns.

A train workflow turns (sampled clients, global model) into a running aggregate
plus one :class:`~core.records.ClientRecord` per sampled client. The plain
workflow (``aggregator.train``) and the secure-aggregation workflow
(``privacy.secagg.train``) share these types, so the round loop has no
``if secagg:``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from flwr.serverapp import Grid

from core.buffer import client_marks
from core.instructions import TrainConfig
from core.layouts import ParamLayout
from core.records import ClientRecord
from core.status import ClientStatus
from core.strategy import ServerState, Strategy

__all__ = ["TrainRequest", "TrainOutcome", "TrainWorkflow", "accumulate", "marked_clients"]

#: The strategy's running aggregate type (:class:`core.strategy.Strategy`'s parameter).
A = TypeVar("A")


@dataclass(frozen=True)
class TrainRequest:
    """What a train workflow needs for one round."""

    server_round: int
    nodes: Sequence[int]
    state: ServerState
    config: TrainConfig
    deadline_s: float
    max_update_bytes: int
    #: The model's tensor names and shapes: the global model goes out as a state dict a stock
    #: Flower client loads, and full-weight replies are read back by these names.
    layout: ParamLayout | None = None


@dataclass
class TrainOutcome(Generic[A]):
    """What one round's train step produced."""

    aggregate: A | None
    clients: list[ClientRecord] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    train_loss: float | None = None
    secagg: dict[str, Any] | None = None


class TrainWorkflow(Protocol):
    """One round's train step: send the training instructions, collect the replies, aggregate them."""

    def __call__(self, grid: Grid, request: TrainRequest, strategy: Strategy[A]) -> TrainOutcome[A]:
        """Run the train step of ``request`` on ``grid`` under ``strategy``."""
        ...


def accumulate(strategy: Strategy[A], agg: A, delta: np.ndarray, num_examples: float) -> A:
    """Fold one decoded (hence already validated) update."""
    return strategy.accumulate(agg, delta, num_examples, checked=True)


def marked_clients(outcome: TrainOutcome[Any]) -> list[ClientRecord]:
    """Return the round's client records with what a robust rule did to each update in their metrics.

    A robust aggregate state (:mod:`core.buffer`) marks updates by arrival
    index (``{"clipped": 1.0}``, ``{"rejected": 1.0}``, ``{"trimmed": f}``);
    the n-th ``ok`` record is the n-th update folded, since a workflow
    records a client as ``ok`` exactly when its update was folded.
    """
    marks = client_marks(outcome.aggregate)
    if not marks:
        return list(outcome.clients)
    records, folded = [], 0
    for record in outcome.clients:
        if record.outcome == ClientStatus.OK:
            mark = marks.get(folded)
            folded += 1
            if mark:
                record = replace(record, metrics={**(record.metrics or {}), **mark})
        records.append(record)
    return records
