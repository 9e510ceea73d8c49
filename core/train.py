"""The train step's types: what a train workflow is asked for and what it returns.

A train workflow turns (sampled clients, global model) into a running aggregate
plus one :class:`~core.records.ClientRecord` per sampled client. The plain
workflow (``aggregator.train``) and the secure-aggregation workflow
(``privacy.secagg.train``) share these types, so the round loop has no
``if secagg:``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from flwr.serverapp import Grid

from core.instructions import TrainConfig
from core.layouts import ParamLayout
from core.records import ClientRecord
from core.strategy import ServerState, Strategy

__all__ = ["TrainRequest", "TrainOutcome", "TrainWorkflow"]

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
    tree: dict[str, Any] | None = None  # under [hierarchy]: one row per edge that trained (aggregator.hierarchy)


class TrainWorkflow(Protocol):
    """One round's train step: send the training instructions, collect the replies, aggregate them."""

    def __call__(self, grid: Grid, request: TrainRequest, strategy: Strategy[A]) -> TrainOutcome[A]:
        """Run the train step of ``request`` on ``grid`` under ``strategy``."""
        ...
