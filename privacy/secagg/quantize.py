"""Fixed-point encoding with unbiased stochastic rounding into ``Z_{2^bits}``.

A client with weight ``w`` in [0, 1] and update ``x`` sends
``[q(w * clip(x)), q(w)]``: the weighted update plus its weight as one more
coordinate, so the server obtains ``sum_i w_i x_i`` and ``sum_i w_i`` from one
secure sum (weighted FedAvg as in Flower's SecAgg+ and Bonawitz et al.,
CCS 2017, Sec. 2). Each coordinate is scaled so that ``n`` clients at the clip
bound still fit in the signed range, which makes decoding a signed view.
Stochastic rounding (``floor(y + u)``, ``u ~ U[0, 1)``) is unbiased, so the
error of the sum is below ``n / scale`` per coordinate and zero in mean
(Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from privacy.dp.discrete import CryptoStream, GridNoise, discrete_gaussian
from privacy.secagg.prg import MaskExpander, dtype_for

__all__ = ["Quantizer"]

# For 64-bit rings the bound stays below 2^52 so float64 holds every
# quantised value exactly.
_FLOAT_EXACT = 1 << 52
_CHUNK = 32768
_SIGNED = {16: np.int16, 32: np.int32, 64: np.int64}


@dataclass(frozen=True)
class Quantizer:
    """Encoder and decoder for one round.

    Parameters
    ----------
    bits : {16, 32, 64}
        Ring width (16 halves the masked vector; ``participants * B`` must stay below 2^15).
    clip_range : float
        Clip bound ``c`` of each coordinate.
    participants : int
        Upper bound on how many vectors are summed (the sampled clients).
    """

    bits: int
    clip_range: float
    participants: int

    @property
    def bound(self) -> int:
        """Per-client bound ``B``: ``|y| <= B`` before rounding, ``|q| <= B + 1`` after.

        ``participants * (B + 1) < 2^(bits-1)``, so the sum never wraps.
        """
        bound: int = (2 ** (self.bits - 1) - 1) // self.participants - 1
        if bound < 1:
            raise ValueError(f"a {self.bits}-bit ring cannot sum {self.participants} clients without wrapping: "
                             "use 32 bits")
        return bound if self.bits < 64 else min(bound, _FLOAT_EXACT)

    @property
    def scale(self) -> float:
        """Quantisation steps per unit of the (weighted) update."""
        return self.bound / self.clip_range

    def encode(self, vector: np.ndarray, weight: float, rng: np.random.Generator) -> np.ndarray:
        """Quantise ``[weight * clip(vector), weight]`` into the ring.

        Parameters
        ----------
        vector : np.ndarray
            1-D finite float update.
        weight : float
            Normalised weight in [0, 1].
        rng : np.random.Generator
            Source of the rounding noise (not secret).
        """
        out, fill = self.encoder(vector, weight, rng)
        fill(0, out.shape[0])
        return out

    def encoder(self, vector: np.ndarray, weight: float, rng: np.random.Generator,
                noise: GridNoise | None = None) -> tuple[np.ndarray, Callable[[int, int], None]]:
        """Return the output buffer and a ``fill(start, stop)`` that encodes ``out[start:stop]``.

        Lets the caller encode a chunk and mask it while it is still in cache
        (:meth:`MaskExpander.add_all`'s ``fill``). Raises ``ValueError`` for a
        non-finite update when the offending chunk is filled.

        ``noise``: this client's share of the distributed discrete Gaussian
        (:mod:`privacy.dp.discrete`), added to every rounded model coordinate
        as integers from a cryptographic stream (never to the weight).
        Wrapping in the ring is harmless; only the sum must fit, and it does
        with ten standard deviations of the summed noise to spare, or this
        raises ``ValueError``.
        """
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"normalised weight must be in [0, 1], got {weight}")
        if vector.ndim != 1:
            raise ValueError("the update must be a 1-D vector")
        d = vector.shape[0]
        out = np.empty(d + 1, dtype=dtype_for(self.bits))
        signed = out.view(_SIGNED[self.bits])
        rounder = _Rounder64(rng) if self.bits == 64 else _Rounder32(rng)
        y = np.empty(max(1, min(d, _CHUNK)))
        factor, limit = weight * self.scale, weight * self.bound
        sigma = self._noise_sigma(noise, factor, d) if noise is not None else 0.0
        stream = CryptoStream() if sigma else None

        def fill(start: int, stop: int) -> None:
            for low in range(start, min(stop, d), _CHUNK):
                high = min(low + _CHUNK, stop, d)
                yv = y[:high - low]
                np.multiply(vector[low:high], factor, out=yv, dtype=np.float64)
                # NaN survives clipping (inf is clipped); one in-cache reduction finds it.
                if not np.isfinite(np.add.reduce(np.clip(yv, -limit, limit, out=yv))):
                    raise ValueError("the update must be finite")
                rounder.round_into(yv, signed[low:high])
                if stream is not None:
                    part = signed[low:high]
                    np.add(part, discrete_gaussian(high - low, sigma, stream).astype(part.dtype), out=part)
            if start <= d < stop:
                rounder.round_into(np.array([limit]), signed[d:])

        return out, fill

    def _noise_sigma(self, noise: GridNoise, factor: float, size: int) -> float:
        """Return the share's ``sigma`` in grid steps, after checking the summed noise cannot wrap the sum."""
        if factor <= 0:
            raise ValueError("discrete noise needs a positive weight")
        sigma = noise.sigma(factor, size)
        spare = 2 ** (self.bits - 1) - 1 - self.participants * (self.bound + 1)
        if 10.0 * sigma * math.sqrt(self.participants) >= spare:
            raise ValueError(f"discrete noise of {sigma:.3g} steps from {self.participants} clients could wrap "
                             f"the {self.bits}-bit sum: raise bits or clip_range, or lower the noise")
        return sigma

    def decode(self, total: np.ndarray) -> tuple[np.ndarray, float]:
        """Signed view of the unmasked sum: ``(sum w_i x_i, sum w_i)`` in float64."""
        signed = total.view(_SIGNED[self.bits])
        values = signed[:-1].astype(np.float64) / self.scale
        return values, float(signed[-1]) / self.bound

    def error_bound(self, contributors: int) -> float:
        """Worst-case absolute error per coordinate of ``sum w_i x_i``."""
        return contributors / self.scale

    def weight_error_bound(self, contributors: int) -> float:
        """Worst-case absolute error of ``sum w_i``."""
        return contributors / self.bound


class _Rounder32:
    """``floor(y + u)`` in integers: ``(floor(y 2^32) + r) >> 32``, ``r`` 32 random bits.

    Exact to 2^-32 of a step (float64 ``y + u`` keeps only 2^-21 near
    2^31), and the noise is an AES-CTR keystream keyed from ``rng``, several
    times cheaper than ``rng.random``.
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self._noise = MaskExpander(_CHUNK, 32).stream(rng.bytes(16))
        self._wide = np.empty(_CHUNK, dtype=np.int64)

    def round_into(self, y: np.ndarray, out: np.ndarray) -> None:
        wide = self._wide[:y.shape[0]]
        y *= 2.0**32
        np.copyto(wide, y, casting="unsafe")
        np.add(wide, self._noise(y.shape[0]), out=wide)
        np.right_shift(wide, 32, out=wide)
        np.copyto(out, wide, casting="unsafe")


class _Rounder64:
    """``floor(y) + (u < frac(y))``: exact for the ``|y| <= 2^52`` of 64-bit rings."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def round_into(self, y: np.ndarray, out: np.ndarray) -> None:
        low = np.floor(y)
        np.copyto(out, low, casting="unsafe")
        out += self._rng.random(y.shape[0]) < (y - low)
