"""The fit step's types: what a fit workflow is asked for and what it returns.

A fit workflow turns (sampled clients, global model) into a running aggregate
plus one :class:`~core.records.ClientRecord` per sampled client. The plain
workflow (``aggregator.fit``) and the secure-aggregation workflow
(``privacy.secagg.fit``) share these types, so the round loop has no
``if secagg:``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.serverapp import Grid

from core.aggregate import MeanState
from core.messages import TrainConfig
from core.records import ClientRecord
from core.strategy import ServerState, Strategy

__all__ = ["FitRequest", "FitOutcome", "FitWorkflow", "accumulate"]


@dataclass(frozen=True)
class FitRequest:
    """What a fit workflow needs for one round."""

    round: int
    nodes: Sequence[int]
    state: ServerState
    config: TrainConfig
    deadline_s: float
    max_update_bytes: int


@dataclass
class FitOutcome:
    """What one round's fit step produced."""

    aggregate: MeanState | None
    clients: list[ClientRecord] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    train_loss: float | None = None
    secagg: dict[str, Any] | None = None


class FitWorkflow(Protocol):
    def __call__(self, grid: Grid, request: FitRequest, strategy: Strategy) -> FitOutcome: ...


def accumulate(strategy: Strategy, agg: MeanState, delta: np.ndarray, num_examples: int,
               metrics: Mapping[str, Any]) -> MeanState:
    """Fold one decoded (hence already validated) update."""
    return strategy.accumulate(agg, delta, num_examples, checked=True)
