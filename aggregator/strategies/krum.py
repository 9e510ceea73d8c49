"""Krum and Multi-Krum.

Blanchard, El Mhamdi, Guerraoui & Stainer, "Machine Learning with
Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017.

Each update is scored by the sum of squared distances to its ``n - f - 2``
nearest neighbours; Krum keeps the lowest-scoring one, Multi-Krum averages
the ``m`` lowest. The selection is Flower's
(``flwr.serverapp.strategy.multikrum.select_multikrum``, behind its ``Krum``
and ``MultiKrum``); the kept updates are averaged with equal weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.serverapp.strategy.multikrum import select_multikrum

from aggregator.strategies.buffered import BufferedStrategy
from core.buffer import UpdateBuffer

__all__ = ["Krum"]


@dataclass(frozen=True)
class Krum(BufferedStrategy):
    """x <- x + server_lr * mean of the ``m`` updates Krum selects.

    Parameters
    ----------
    num_byzantine : int
        ``f``, the number of Byzantine clients the rule must tolerate.
    num_selected : int
        ``m``: 1 is Krum, more is Multi-Krum.
    """

    num_byzantine: int = 0
    num_selected: int = 1
    name: str = "krum"

    def __post_init__(self) -> None:
        """Refuse a negative ``num_byzantine`` or a ``num_selected`` below 1."""
        if self.num_byzantine < 0:
            raise ValueError(f"num_byzantine must be >= 0, got {self.num_byzantine}")
        if self.num_selected < 1:
            raise ValueError(f"num_selected must be >= 1, got {self.num_selected}")

    def combine(self, agg: UpdateBuffer) -> np.ndarray:
        """Return the equal-weight mean of the selected updates; mark the others ``rejected``."""
        chosen = self.select(agg)
        for index in range(agg.count):
            if index not in chosen:
                agg.marks[index] = {"rejected": 1.0}
        mean: np.ndarray = np.mean(np.stack([agg.updates[i] for i in chosen]), axis=0)
        return mean

    def select(self, agg: UpdateBuffer) -> list[int]:
        """Arrival indices of the updates Multi-Krum keeps, best first."""
        contents = [RecordDict({"u": ArrayRecord({"delta": Array(u)})}) for u in agg.updates]
        keep = min(self.num_selected, agg.count)
        position = {id(c): i for i, c in enumerate(contents)}
        return [position[id(c)] for c in select_multikrum(contents, self.num_byzantine, keep)]
