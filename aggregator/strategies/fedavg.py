"""FedAvg (McMahan et al., AISTATS 2017) with an optional server learning rate."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.strategy import MeanStrategy, ServerState

__all__ = ["FedAvg"]


@dataclass(frozen=True)
class FedAvg(MeanStrategy):
    """x <- x + server_lr * mean_i(delta_i), weighted by example counts.

    With ``server_lr = 1`` this is the weighted average of the client models.
    """

    server_lr: float = 1.0
    name: str = "fedavg"

    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """Step the global model by ``server_lr`` times the mean delta."""
        params = state.params + np.float32(self.server_lr) * mean_delta
        return state.advanced(params.astype(np.float32, copy=False))
