"""The distributed discrete Gaussian: integer noise on the secure-aggregation grid, from a cryptographic stream.

Kairouz, Liu & Steinke, "The Distributed Discrete Gaussian Mechanism for
Federated Learning with Secure Aggregation", ICML 2021. Each of the ``K``
sampled clients clips its update to L2 norm ``C``, rounds it onto the
secure-aggregation grid (``scale`` steps per unit, :class:`privacy.secagg.quantize.Quantizer`)
and adds integer noise ``N_Z(0, sigma^2)`` to every coordinate; secure
aggregation sums the integers, so the server only ever sees integers plus
the sum of ``K`` discrete Gaussians.

Sensitivity on the grid: rounding moves each coordinate by less than one
step, so a clipped, rounded update has L2 norm at most ``C scale + sqrt(d)``
(``d`` coordinates): the noise is calibrated to that, ``sigma = z (C scale +
sqrt(d)) / sqrt(K)``, and the sum of ``K`` shares then satisfies
``eps^2 / 2``-concentrated DP with (Kairouz et al., Theorem 1 and eq. 4)::

    eps = min( sqrt(D2^2 / (K sigma^2) + tau D1 / 2),  D2 / (sqrt(K) sigma) + tau sqrt(D1) )
    tau = 10 sum_{k=1}^{K-1} exp(-2 pi^2 sigma^2 k / (k + 1))

with ``D2`` the L2 and ``D1`` the L1 sensitivity. ``tau`` measures how far a
sum of discrete Gaussians is from a discrete Gaussian; it vanishes as
``sigma`` grows (``sigma = 2`` gives about 1e-33). Clients refuse a grid on
which their ``sigma`` would be below :data:`MIN_SIGMA` steps, so ``tau`` is 0
in float64 and each round's privacy is that of the Gaussian mechanism with
noise multiplier ``z``: the accountant's events are unchanged, only the
sensitivity carries the rounding's ``sqrt(d)``.

Randomness comes from :class:`CryptoStream`, AES-128 in counter mode under a
key from the OS CSPRNG (never numpy's generators): nobody, the aggregator
included, can regenerate a client's noise. The sampler is Canonne, Kamath &
Steinke ("The Discrete Gaussian for Differential Privacy", NeurIPS 2020,
Algorithm 3): a discrete Laplace proposal (the difference of two geometric
variables) accepted with probability ``exp(-(|y| - sigma^2/t)^2 / (2 sigma^2))``,
``t = floor(sigma) + 1``, vectorised over the coordinates. Uniforms carry 53
random bits, so probabilities are exact to float64 (the original algorithm
works on exact rationals), and ``sigma`` is capped at :data:`MAX_SIGMA`
(2^46 steps) so that every proposal is computed as an exact integer: above
that, float64 would put the noise on a lattice of even numbers and leave
the low bits of the sum noise-free.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["MIN_SIGMA", "MAX_SIGMA", "CryptoStream", "GridNoise", "discrete_gaussian", "ddg_tau", "ddg_epsilon",
           "discrete_gaussian_pmf"]

#: A client refuses to add discrete noise of fewer grid steps than this: ``tau`` is then 0 in float64.
MIN_SIGMA = 64.0
_TWO_POW_53 = float(1 << 53)
#: The largest ``sigma`` (grid steps) sampled exactly: the geometric draws ``floor(-t ln U)`` reach
#: ``37 t`` (``U >= 2^-53``), and float64 holds every integer only below 2^53, so ``t <= 2^47``.
MAX_SIGMA = 2.0**46


class CryptoStream:
    """Uniform variates from AES-128-CTR under a fresh 16-byte key from :func:`os.urandom`.

    Parameters
    ----------
    key : bytes | None
        A fixed key, for tests only; ``None`` draws one from the OS CSPRNG
        (never stored).
    """

    def __init__(self, key: bytes | None = None) -> None:
        key = os.urandom(16) if key is None else key
        if len(key) != 16:
            raise ValueError(f"an AES-128 key is 16 bytes, got {len(key)}")
        self._encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()

    def words(self, count: int) -> np.ndarray:
        """``count`` uniformly random 64-bit words."""
        data = self._encryptor.update(bytes(8 * count))
        return np.frombuffer(data, dtype="<u8").copy()

    def uniform(self, count: int) -> np.ndarray:
        """``count`` float64 variates uniform on ``(0, 1]``, 53 random bits each."""
        return ((self.words(count) >> np.uint64(11)).astype(np.float64) + 1.0) / _TWO_POW_53

    def normal(self, count: int, std: float) -> np.ndarray:
        """``count`` draws of ``N(0, std^2)`` (Box-Muller on :meth:`uniform`), float64."""
        half = (count + 1) // 2
        radius = np.sqrt(-2.0 * np.log(self.uniform(half)))
        angle = 2.0 * math.pi * self.uniform(half)
        return (np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]) * std


def discrete_gaussian(count: int, sigma: float, stream: CryptoStream) -> np.ndarray:
    """``count`` i.i.d. draws of the discrete Gaussian ``N_Z(0, sigma^2)``, as int64.

    ``P(Y = y)`` is proportional to ``exp(-y^2 / (2 sigma^2))`` for every integer ``y``.
    """
    if not (sigma > 0 and math.isfinite(sigma)) or sigma > MAX_SIGMA:
        raise ValueError(f"sigma must be a positive number at most 2^46, got {sigma:.4g}")
    t = math.floor(sigma) + 1
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        want = count - filled
        batch = int(want * 1.6) + 64  # acceptance is above 0.6 for every sigma
        u = stream.uniform(3 * batch).reshape(3, batch)
        # Geometric(1 - e^{-1/t}) on {0, 1, ...}: P(G >= k) = e^{-k/t}, so G = floor(-t ln U).
        g1, g2 = np.floor(-t * np.log(u[0])), np.floor(-t * np.log(u[1]))
        y = g1 - g2
        accept = u[2] <= np.exp(-((np.abs(y) - sigma * sigma / t) ** 2) / (2.0 * sigma * sigma))
        kept = y[accept][:want]
        out[filled:filled + kept.size] = kept.astype(np.int64)
        filled += kept.size
    return out


def discrete_gaussian_pmf(values: np.ndarray, sigma: float) -> np.ndarray:
    """Return the exact probabilities ``P(Y = values)`` of ``N_Z(0, sigma^2)`` (normalised over +-40 sigma)."""
    support = np.arange(-math.ceil(40 * sigma), math.ceil(40 * sigma) + 1)
    norm = float(np.sum(np.exp(-(support.astype(np.float64) ** 2) / (2 * sigma * sigma))))
    return np.exp(-(np.asarray(values, dtype=np.float64) ** 2) / (2 * sigma * sigma)) / norm


def ddg_tau(sigma: float, clients: int) -> float:
    """``tau = 10 sum_{k=1}^{K-1} exp(-2 pi^2 sigma^2 k / (k + 1))`` (Kairouz et al., Theorem 1)."""
    k = np.arange(1, max(clients, 1), dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * sigma**2 * k / (k + 1.0))))


def ddg_epsilon(l2_sensitivity: float, l1_sensitivity: float, sigma: float, clients: int) -> float:
    """Return the ``eps`` of the ``eps^2 / 2``-concentrated DP of a sum of ``clients`` shares ``N_Z(0, sigma^2)``.

    Kairouz et al., ICML 2021, Theorem 1: ``min(sqrt(D2^2 / (K s^2) + tau D1 / 2),
    D2 / (sqrt(K) s) + tau sqrt(D1))``.
    """
    if sigma <= 0 or clients < 1:
        raise ValueError(f"need sigma > 0 and at least one client, got {sigma} and {clients}")
    tau = ddg_tau(sigma, clients)
    variance = clients * sigma * sigma
    return min(math.sqrt(l2_sensitivity**2 / variance + tau * l1_sensitivity / 2.0),
               l2_sensitivity / math.sqrt(variance) + tau * math.sqrt(l1_sensitivity))


@dataclass(frozen=True)
class GridNoise:
    """A client's discrete noise share, as the round told it in update units; turned into grid steps at encoding.

    Attributes
    ----------
    noise_std : float
        ``z C / sqrt(K)``: the share's standard deviation in update units.
    clip : float
        ``C``, the L2 bound the client clipped its update to.
    """

    noise_std: float
    clip: float

    def __post_init__(self) -> None:
        """Refuse a noise std or clip norm that is not positive and finite."""
        if not (self.noise_std > 0 and self.clip > 0 and math.isfinite(self.noise_std) and math.isfinite(self.clip)):
            raise ValueError(f"grid noise needs a positive finite noise_std and clip, got {self}")

    def sigma(self, scale: float, size: int) -> float:
        """Return this share's ``sigma`` in grid steps: ``z (C scale + sqrt(d)) / sqrt(K)``.

        ``C scale + sqrt(d)`` is the L2 sensitivity on the grid (rounding moves
        each of the ``d`` coordinates by less than one step).

        Raises
        ------
        ValueError
            A grid so coarse that ``sigma`` is below :data:`MIN_SIGMA` steps.
        """
        sigma = self.noise_std / self.clip * (self.clip * scale + math.sqrt(size))
        if sigma < MIN_SIGMA:
            raise ValueError(f"discrete noise of {sigma:.3g} grid steps is below {MIN_SIGMA:g}: "
                             "the grid is too coarse for the distributed discrete Gaussian (use bits = 64)")
        if sigma > MAX_SIGMA:
            raise ValueError(f"discrete noise of {sigma:.3g} grid steps is above 2^46, which float64 cannot "
                             "sample exactly: the grid is too fine (raise secagg.clip_range)")
        return sigma
