"""Coordinate-wise trimmed mean (Yin, Chen, Kannan & Bartlett, ICML 2018).

For every coordinate the ``floor(beta * n)`` largest and smallest values are
dropped and the rest averaged. The math is Flower's
(``flwr.serverapp.strategy.fedtrimmedavg.trim_mean``, behind its
``FedTrimmedAvg``), applied to the stacked flat update buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean

from aggregator.strategies.buffered import BufferedStrategy
from core.buffer import UpdateBuffer

__all__ = ["FedTrimmedMean"]


@dataclass(frozen=True)
class FedTrimmedMean(BufferedStrategy):
    """x <- x + server_lr * trimmed_mean_beta(delta_i), every client weighing 1.

    Parameters
    ----------
    beta : float
        Fraction cut at each end, in [0, 0.5).
    """

    beta: float = 0.2
    name: str = "trimmed_mean"

    def __post_init__(self) -> None:
        """Refuse a trim fraction ``beta`` outside [0, 0.5)."""
        if not 0 <= self.beta < 0.5:
            raise ValueError(f"trim fraction beta must be in [0, 0.5), got {self.beta}")

    def combine(self, agg: UpdateBuffer) -> np.ndarray:
        """Return the coordinate-wise ``beta``-trimmed mean; mark each client by the fraction of it trimmed."""
        stacked = agg.stacked()
        cut = int(self.beta * agg.count)
        if cut:
            _mark_trimmed(agg, stacked, cut)
        return np.asarray(trim_mean(stacked, self.beta))



def _mark_trimmed(agg: UpdateBuffer, stacked: np.ndarray, cut: int) -> None:
    """Record, per client, the fraction of its coordinates that fell among the ``cut`` at either end."""
    ranks = np.argsort(np.argsort(stacked, axis=0, kind="stable"), axis=0, kind="stable")
    outside = (ranks < cut) | (ranks >= agg.count - cut)
    for index, fraction in enumerate(outside.mean(axis=1)):
        if fraction > 0:
            agg.marks[index] = {"trimmed": float(fraction)}
