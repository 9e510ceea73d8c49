"""FedAvgM: server momentum.

Hsu et al., "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", 2019.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.strategy import MeanStrategy, ServerState

__all__ = ["FedAvgM"]


@dataclass(frozen=True)
class FedAvgM(MeanStrategy):
    """m <- beta * m + delta;  x <- x + server_lr * m."""

    server_lr: float = 1.0
    momentum: float = 0.9
    name: str = "fedavgm"

    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """Update the momentum (the mean delta itself in round 1) and step the model by ``server_lr`` times it."""
        previous = state.slots.get("momentum")
        momentum = mean_delta.copy() if previous is None else np.float32(self.momentum) * previous + mean_delta
        params = state.params + np.float32(self.server_lr) * momentum
        return state.advanced(params.astype(np.float32, copy=False), momentum=momentum)
