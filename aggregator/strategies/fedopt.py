"""Adaptive server optimisers FedAdagrad, FedAdam and FedYogi.

Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2:
the mean client delta is treated as a pseudo-gradient::

    m <- b1 * m + (1 - b1) * delta
    v <- v + delta^2                                      (FedAdagrad)
    v <- b2 * v + (1 - b2) * delta^2                      (FedAdam)
    v <- v - (1 - b2) * delta^2 * sign(v - delta^2)       (FedYogi)
    x <- x + eta * m / (sqrt(v) + tau)

with ``m_0 = 0`` and ``v_0 = tau^2`` (the paper requires ``v_{-1} >= tau^2``),
and no bias correction (as the paper).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from core.strategy import MeanStrategy, ServerState

__all__ = ["FedAdagrad", "FedAdam", "FedYogi"]


@dataclass(frozen=True)
class _FedOpt(MeanStrategy):
    server_lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        m = state.slots.get("m")
        v = state.slots.get("v")
        if m is None or v is None:
            m = np.zeros_like(mean_delta)
            v = np.full_like(mean_delta, np.float32(self.tau**2))
        m = np.float32(self.beta1) * m + np.float32(1 - self.beta1) * mean_delta
        v = self._second_moment(v, mean_delta * mean_delta)
        step = np.float32(self.server_lr) * m / (np.sqrt(v) + np.float32(self.tau))
        return state.advanced((state.params + step).astype(np.float32, copy=False), m=m, v=v)



@dataclass(frozen=True)
class FedAdam(_FedOpt):
    """FedAdam: Adam's second moment on the server."""

    name: str = "fedadam"

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        return np.float32(self.beta2) * v + np.float32(1 - self.beta2) * delta_sq


@dataclass(frozen=True)
class FedYogi(_FedOpt):
    """FedYogi: Yogi's additive, sign-controlled second moment on the server."""

    name: str = "fedyogi"

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        moment: np.ndarray = v - np.float32(1 - self.beta2) * delta_sq * np.sign(v - delta_sq)
        return moment


@dataclass(frozen=True)
class FedAdagrad(_FedOpt):
    """FedAdagrad: Adagrad's running sum of squares on the server (``beta2`` does not apply)."""

    name: str = "fedadagrad"
    beta2: float = field(default=0.99, repr=False)  # Adagrad has no second-moment decay: not recorded

    def _second_moment(self, v: np.ndarray, delta_sq: np.ndarray) -> np.ndarray:
        moment: np.ndarray = v + delta_sq
        return moment
