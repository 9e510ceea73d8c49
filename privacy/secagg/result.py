"""What a finished round reports: the sum, who is in it, and per-stage costs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from privacy.secagg.stage import Stage

_T = TypeVar("_T")

__all__ = ["SecureSumResult", "StageStats", "ServerTimer"]


class ServerTimer:
    """Accumulates the server's share of a stage's time (``StageStats.server_seconds``)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.total = 0.0

    def run(self, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)``, its time added to :attr:`total`."""
        start = self.clock()
        try:
            return fn(*args)
        finally:
            self.total += self.clock() - start


@dataclass(frozen=True)
class StageStats:
    """Cost of one stage as seen by the server.

    Attributes
    ----------
    stage : Stage
        Which stage.
    completed : tuple[int, ...]
        Clients whose reply for this stage was accepted.
    bytes_up, bytes_down : int
        Protocol bytes received from / sent to clients (encoded messages and
        masked vectors; the global model embedded by the Flower workflow is
        not counted).
    seconds : float
        Wall time of the stage, client work included when in-process.
    server_seconds : float
        Of which spent in server computation.
    wire_up, wire_down : Mapping[int, int]
        Per client: its reply and its request as serialised on Flower's wire
        (``core.wire.wire_bytes``; the embedded global model included).
    rejected : Mapping[int, str]
        Per client whose reply the server refused at this stage: why, on one line.
    failed : Mapping[int, str]
        Per client whose task raised at this stage (an error reply that is not a
        node gone): the error it reported, on one line.
    refused : Mapping[int, str]
        Per client whose site policy refused the round at this stage
        (``core.replies.refusal``): the rule it named, on one line.
    """

    stage: Stage
    completed: tuple[int, ...]
    bytes_up: int
    bytes_down: int
    seconds: float
    server_seconds: float
    wire_up: Mapping[int, int] = field(default_factory=dict)
    wire_down: Mapping[int, int] = field(default_factory=dict)
    rejected: Mapping[int, str] = field(default_factory=dict)
    failed: Mapping[int, str] = field(default_factory=dict)
    refused: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class SecureSumResult:
    """Outcome of one secure-aggregation round.

    Attributes
    ----------
    total : np.ndarray
        ``sum_i w_i x_i`` (float64) over :attr:`survivors`, each ``x_i``
        clipped to the clip range and each ``w_i`` capped at ``max_weight``.
    total_weight : float
        ``sum_i w_i`` over :attr:`survivors`.
    survivors : tuple[int, ...]
        Clients whose inputs are in the sum.
    stages : tuple[StageStats, ...]
        One entry per stage, in order.
    error_bound : float
        Worst-case quantisation error of any coordinate of :attr:`total`.
    client_metrics : Mapping[int, dict]
        Per-survivor training metrics (Flower workflow only).
    """

    total: np.ndarray
    total_weight: float
    survivors: tuple[int, ...]
    stages: tuple[StageStats, ...]
    error_bound: float
    client_metrics: Mapping[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def mean(self) -> np.ndarray:
        """The weighted mean ``total / total_weight`` (weighted FedAvg)."""
        if self.total_weight <= 0:
            raise ZeroDivisionError("the survivors' total weight is zero")
        return self.total / self.total_weight

    def seconds(self) -> float:
        """Wall time of the whole round."""
        return sum(s.seconds for s in self.stages)
