"""The Gaussian mechanism's two halves: clip to an L2 ball, add calibrated noise.

Client-level DP-FedAvg (McMahan et al., "Learning Differentially Private
Recurrent Language Models", ICLR 2018, Algorithm 1) bounds each client's
influence by clipping its model update to L2 norm ``C`` and then adds
Gaussian noise of standard deviation ``z * C`` to the sum of updates. This
module holds those pure pieces, plus the client side of the distributed
placement, where each of the ``K`` sampled clients adds its share ``z * C / sqrt(K)``
before secure aggregation sums the shares to the full ``z * C``.

What a client must do is carried by :class:`ClientDPConfig`, which travels in
the round's instruction as the ``DP_*`` settings of :mod:`core.instructions`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from core.instructions import (
    DP_ADAPTIVE,
    DP_CLIP,
    DP_COUNT_NOISE_STD,
    DP_DISCRETE,
    DP_NOISE_STD,
    Setting,
    SettingValue,
    TrainConfig,
)
from privacy.dp.discrete import GridNoise
from privacy.dp.errors import DPConfigError

__all__ = [
    "ClientDPConfig", "l2_norm", "clip_factor", "clip_update", "gaussian_noise",
    "privatize_update", "client_payload",
]

Placement = Literal["central", "distributed"]

# Scaling by exactly C / norm can land a float32 vector a few ulps above C;
# shrinking by one part in a million keeps the sensitivity bound strict.
_CLIP_MARGIN = 1e-6


@dataclass(frozen=True)
class ClientDPConfig:
    """What one client needs for client-level DP in one round.

    Attributes
    ----------
    clip : float
        L2 bound ``C`` for the client's update this round.
    noise_std : float
        Standard deviation of the Gaussian noise the client adds to every
        coordinate of its clipped update (distributed placement), else 0.
    adaptive : bool
        Whether the client appends its clipped-or-not bit (Andrew et al. 2021)
        as one extra coordinate of its update.
    count_noise_std : float
        The client's share of the noise on that bit (distributed), else 0.
    discrete : bool
        Whether the noise share is the distributed discrete Gaussian, added by
        secure aggregation's encoder on its integer grid
        (:mod:`privacy.dp.discrete`) instead of in floats here.
    """

    clip: float
    noise_std: float = 0.0
    adaptive: bool = False
    count_noise_std: float = 0.0
    discrete: bool = False

    def to_settings(self) -> dict[Setting[Any], SettingValue]:
        """Return the instruction settings that tell a client what to do."""
        return {DP_CLIP: self.clip, DP_NOISE_STD: self.noise_std, DP_ADAPTIVE: self.adaptive,
                DP_COUNT_NOISE_STD: self.count_noise_std, DP_DISCRETE: self.discrete}

    @classmethod
    def from_config(cls, config: TrainConfig) -> ClientDPConfig | None:
        """Read the DP settings of a round's instruction back; ``None`` when the round carries no DP.

        Raises
        ------
        DPConfigError
            A clip norm not above 0, negative noise, or discrete noise without noise or with the adaptive bit.
        """
        clip = config.get(DP_CLIP)
        if clip is None:
            return None
        noise, count_noise = config.get(DP_NOISE_STD), config.get(DP_COUNT_NOISE_STD)
        out = cls(clip=clip, noise_std=noise or 0.0, adaptive=config.get(DP_ADAPTIVE) is True,
                  count_noise_std=count_noise or 0.0, discrete=config.get(DP_DISCRETE) is True)
        shown = {k: v for k, v in config.settings.items() if k.startswith("dp-")}
        if not (out.clip > 0 and out.noise_std >= 0 and out.count_noise_std >= 0):
            raise DPConfigError("client_config", shown, "needs dp-clip > 0 and non-negative noise")
        if out.discrete and (out.noise_std <= 0 or out.adaptive):
            raise DPConfigError("client_config", shown, "discrete noise needs dp-noise-std > 0 and no adaptive bit")
        return out

    def grid_noise(self) -> GridNoise | None:
        """Return the discrete share secure aggregation's encoder adds, or ``None`` (continuous or no noise)."""
        return GridNoise(self.noise_std, self.clip) if self.discrete else None


def l2_norm(vector: np.ndarray) -> float:
    """L2 norm of a float32 buffer, accumulated in float64 without a copy."""
    return math.sqrt(float(np.einsum("i,i->", vector, vector, dtype=np.float64)))


def clip_factor(norm: float, clip: float) -> float:
    """Return the scale ``min(1, C / norm)`` that brings a vector of ``norm`` inside the ``clip`` ball."""
    if norm <= clip:
        return 1.0
    return clip / norm * (1.0 - _CLIP_MARGIN)


def clip_update(update: np.ndarray, clip: float) -> tuple[np.ndarray, float]:
    """Return ``update`` scaled into the L2 ball of radius ``clip`` (a new array) and its norm before.

    The result's norm never exceeds ``clip``, also after float32 rounding.
    """
    norm = l2_norm(update)
    scaled = np.multiply(update, np.float32(clip_factor(norm, clip)), dtype=np.float32)
    return scaled, norm


def gaussian_noise(size: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` i.i.d. draws of N(0, std^2) as float32 (zeros when ``std`` is 0)."""
    noise = np.zeros(size, dtype=np.float32)
    if std > 0:
        rng.standard_normal(out=noise, dtype=np.float32)
        noise *= np.float32(std)
    return noise


def privatize_update(
    delta: np.ndarray, clip: float, noise_std: float, rng: np.random.Generator
) -> tuple[np.ndarray, float, bool]:
    """Clip a client's update and add its share of the Gaussian noise.

    Parameters
    ----------
    delta : np.ndarray
        The client's model update, a 1-D float32 buffer (left untouched).
    clip : float
        L2 bound ``C``.
    noise_std : float
        Per-coordinate noise std this client adds: ``z * C / sqrt(K)`` in the
        distributed placement, 0 in the central one.
    rng : np.random.Generator
        Noise source; pass :func:`privacy.dp.secure_rng` outside tests.

    Returns
    -------
    (np.ndarray, float, bool)
        The privatised update, its L2 norm before clipping and whether that
        norm was at most ``C`` (the bit adaptive clipping counts).

    References
    ----------
    McMahan et al., ICLR 2018, Algorithm 1 (``ClipFn``); Kairouz et al., "The
    Distributed Discrete Gaussian Mechanism for Federated Learning with
    Secure Aggregation", ICML 2021, for noise shares summed by secure aggregation.
    """
    clipped, norm = clip_update(np.asarray(delta, dtype=np.float32), clip)
    if noise_std > 0:
        clipped += gaussian_noise(clipped.size, noise_std, rng)
    return clipped, norm, norm <= clip


def client_payload(delta: np.ndarray, config: ClientDPConfig | None, rng: np.random.Generator) -> np.ndarray:
    """Return what a client sends in a DP round: the privatised update, plus its count bit when adaptive.

    With adaptive clipping the last coordinate is ``b - 1/2 + noise`` where
    ``b = 1[norm <= C]``: centring the bit halves its sensitivity (Andrew et
    al., "Differentially Private Learning with Adaptive Clipping", NeurIPS
    2021, section 3) and riding inside the vector lets secure aggregation sum
    it with the update, so the server never sees one client's bit.
    """
    if config is None:
        return delta
    noise_std = 0.0 if config.discrete else config.noise_std  # discrete: added on the grid by secagg
    update, _, below = privatize_update(delta, config.clip, noise_std, rng)
    if not config.adaptive:
        return update
    bit = (0.5 if below else -0.5) + config.count_noise_std * float(rng.standard_normal())
    return np.append(update, np.float32(bit)).astype(np.float32, copy=False)
