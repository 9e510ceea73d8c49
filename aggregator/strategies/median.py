"""Coordinate-wise median.

Yin, Chen, Kannan & Bartlett, "Byzantine-Robust Distributed Learning: Towards
Optimal Statistical Rates", ICML 2018.

The math is Flower's (``flwr.server.strategy.aggregate.aggregate_median``, the
rule behind its ``FedMedian``), applied to the flat update buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.server.strategy.aggregate import aggregate_median

from aggregator.strategies.buffered import BufferedStrategy
from core.buffer import UpdateBuffer

__all__ = ["FedMedian"]


@dataclass(frozen=True)
class FedMedian(BufferedStrategy):
    """x <- x + server_lr * median_i(delta_i), coordinate by coordinate, every client weighing 1."""

    name: str = "median"

    def combine(self, agg: UpdateBuffer) -> np.ndarray:
        """Return the coordinate-wise median of the buffered updates (Flower's ``aggregate_median``)."""
        return aggregate_median([([update], 1) for update in agg.updates])[0]
