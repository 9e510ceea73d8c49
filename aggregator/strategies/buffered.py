"""The base of robust rules that need every update of a round at once.

Coordinate-wise median, trimmed mean and Krum rank or compare the individual
updates, so they cannot be folded into a running sum: their aggregate state is
a :class:`core.buffer.UpdateBuffer` that holds the list (memory O(clients x
model)), and :attr:`BufferedStrategy.needs_all_updates` says so in the type.
The train workflows still drive them through ``new_aggregate`` / ``accumulate``
/ ``finalize``, so the round loop has no branch on the kind of strategy.

Every update counts once: these rules were analysed with equal weights
(Yin et al., ICML 2018; Blanchard et al., NeurIPS 2017), and a reported
example count is exactly what a Byzantine client would inflate.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from core.buffer import UpdateBuffer, buffer_add, empty_buffer
from core.strategy import ServerState, Strategy

__all__ = ["BufferedStrategy"]


@dataclass(frozen=True)
class BufferedStrategy(Strategy[UpdateBuffer]):
    """A robust rule over the buffered updates; the server step is FedAvg's ``x + server_lr * agg``."""

    server_lr: float = 1.0
    needs_all_updates: ClassVar[bool] = True

    def new_aggregate(self, size: int) -> UpdateBuffer:
        """Return an empty update buffer for a model of ``size`` parameters."""
        return empty_buffer(size)

    def accumulate(self, agg: UpdateBuffer, update: np.ndarray, num_examples: float, *,
                   checked: bool = False) -> UpdateBuffer:
        """Append one client's update to the buffer, with its example count."""
        return buffer_add(agg, update, float(num_examples), checked=checked)

    def finalize(self, agg: UpdateBuffer, rng: np.random.Generator) -> np.ndarray:  # noqa: ARG002 (Strategy's)
        """Return the robust aggregate of the buffered updates, as float32.

        Raises
        ------
        ValueError
            The buffer holds no update.
        """
        if agg.count == 0:
            raise ValueError("cannot finalize an empty aggregate: no update was added")
        return np.asarray(self.combine(agg), dtype=np.float32)

    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """Step the global model by ``server_lr`` times the robust aggregate (FedAvg's server step)."""
        params = state.params + np.float32(self.server_lr) * mean_delta
        return state.advanced(params.astype(np.float32, copy=False))

    @abstractmethod
    def combine(self, agg: UpdateBuffer) -> np.ndarray:
        """Return the robust aggregate of ``agg.updates``; may record ``agg.marks``."""
