"""Compressed updates: composable uplink encoders with exact decoders.

An uplink :class:`Codec` is a chain of at most two encoders over one flat
float32 update ``x`` of ``d`` values:

1. a **sparsifier** keeps ``k`` of the ``d`` coordinates:

   - ``topk``: the ``k`` largest magnitudes; their coordinates travel as
     byte gaps (:func:`encode_gaps`; Aji and Heafield 2017; Lin et al.,
     "Deep Gradient Compression", ICLR 2018);
   - ``randomk``: the same ``k`` coordinates for every client of a round,
     drawn from the round's shared seed, so no index travels and secure
     aggregation masks just those ``k`` values (Stich, Cordonnier and Jaggi,
     "Sparsified SGD with Memory", NeurIPS 2018);

2. a **quantiser** sends each kept value in ``bits`` bits: unbiased
   stochastic rounding onto ``L = 2^bits`` evenly spaced levels spanning
   ``[-m, m]``, ``m`` the largest kept magnitude (QSGD, Alistarh et al.,
   NeurIPS 2017, with max scaling instead of the norm).

Error bounds of ``x_hat = decode(encode(x))``, per coordinate:

- quantisation: ``E[x_hat] = x``; ``|x_hat - x| < step = 2 m / (L - 1)``;
  ``Var[x_hat] <= step^2 / 4``;
- sparsification: ``x_hat = x`` on the kept coordinates and 0 elsewhere. With
  error feedback nothing is rescaled (the residual sends the rest later);
  without it random-k rescales by ``d / k``, which makes it unbiased over the
  draw of coordinates, except under DP (``rescale = False``): scaling a
  clipped update by ``d / k`` before the noise would multiply its
  sensitivity.

**Error feedback** (Seide et al. 2014; Karimireddy et al., ICML 2019): the
client sends ``C(x + e)`` and keeps ``e' = x + e - decode(C(x + e))``; the
residual lives in the client's state across rounds (:func:`with_feedback`).

The decoder trusts nothing: the server decodes with the codec *it* asked for
(sizes, bits and the random-k coordinates are its own), and a payload of the
wrong dtype, length or range, an unsorted or out-of-range index, or a
non-finite scale is refused with :class:`~core.errors.UpdateRejected`.

The downlink's encoder is :mod:`core.broadcast`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array

from core.errors import UpdateRejected
from core.instructions import (
    CODEC_BITS,
    CODEC_FEEDBACK,
    CODEC_RANDOMK,
    CODEC_RESCALE,
    CODEC_SEED,
    CODEC_TOPK,
    Setting,
    SettingValue,
    TrainConfig,
)
from core.layouts import typed_array, typed_view

__all__ = ["Codec", "with_feedback", "quantize", "dequantize", "pack_bits", "unpack_bits",
           "top_k_index", "shared_index", "encode_gaps", "decode_gaps"]

#: The largest magnitude a quantised payload may declare (beyond it a reply is refused).
MAX_SCALE = 1e30
_U8, _F32 = np.dtype(np.uint8), np.dtype("<f4")


#: Codes packed or unpacked per pass: a multiple of 8, so every chunk but the last fills whole bytes,
#: and the bit planes of a pass stay at 16 MiB whatever the model's size.
_PACK_CHUNK = 1 << 20


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """``codes`` (each below ``2^bits``) packed ``bits`` bits apiece, little-endian, into bytes."""
    wide = np.ascontiguousarray(codes, dtype="<u2")
    if bits in (8, 16):  # whole bytes: no bit planes
        return np.ascontiguousarray(wide.astype(np.uint8) if bits == 8 else wide).view(np.uint8).copy()
    out = np.empty((wide.size * bits + 7) // 8, dtype=np.uint8)
    for start in range(0, wide.size, _PACK_CHUNK):
        part = wide[start:start + _PACK_CHUNK]
        planes = np.unpackbits(part.view(np.uint8).reshape(-1, 2), axis=1, bitorder="little")[:, :bits]
        packed = np.packbits(planes.reshape(-1), bitorder="little")
        out[start * bits // 8:start * bits // 8 + packed.size] = packed
    return out


def unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Unpack the ``count`` codes :func:`pack_bits` packed (``uint16``)."""
    if bits == 8:
        return packed[:count].astype(np.uint16)
    if bits == 16:
        return packed[:2 * count].view("<u2").astype(np.uint16)
    out = np.empty(count, dtype=np.uint16)
    for start in range(0, count, _PACK_CHUNK):
        n = min(_PACK_CHUNK, count - start)
        part = packed[start * bits // 8:(start * bits + n * bits + 7) // 8]
        planes = np.unpackbits(part, count=n * bits, bitorder="little").reshape(n, bits)
        full = np.zeros((n, 16), dtype=np.uint8)
        full[:, :bits] = planes
        out[start:start + n] = np.packbits(full, axis=1, bitorder="little").view("<u2").reshape(-1)
    return out


def quantize(values: np.ndarray, bits: int, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Unbiased stochastic rounding of ``values`` onto ``2^bits`` levels over ``[-m, m]``.

    Returns the codes (``uint16``, each in ``[0, 2^bits)``) and ``m``.
    """
    m = float(np.max(np.abs(values))) if values.size else 0.0
    levels = (1 << bits) - 1
    if m == 0.0:
        return np.zeros(values.size, dtype=np.uint16), 0.0
    y = (values.astype(np.float64) + m) * (levels / (2.0 * m))
    low = np.floor(y)
    codes = low + (rng.random(values.size) < (y - low))
    return np.clip(codes, 0, levels).astype(np.uint16), m


def dequantize(codes: np.ndarray, bits: int, m: float) -> np.ndarray:
    """Return the values the codes stand for: ``-m + code * 2m / (2^bits - 1)``, float32."""
    step = 2.0 * m / ((1 << bits) - 1)
    return (codes.astype(np.float64) * step - m).astype(np.float32)


def top_k_index(vector: np.ndarray, k: int) -> np.ndarray:
    """Return the sorted indices of the ``k`` largest magnitudes of ``vector`` (``uint32``)."""
    if k >= vector.size:
        return np.arange(vector.size, dtype=np.uint32)
    part = np.argpartition(np.abs(vector), vector.size - k)[vector.size - k:]
    return np.sort(part).astype(np.uint32)


#: A gap token that carries 255 and no coordinate (the next token continues the same gap).
_ESCAPE = 255


def encode_gaps(index: np.ndarray) -> np.ndarray:
    """Encode sorted coordinates as byte gaps.

    The first coordinate, then each one's distance to the previous, every gap
    written as ``g // 255`` escape bytes (255) and one byte ``g % 255``. At 1%
    density the mean gap is 100, so a coordinate costs about 1.1 bytes instead
    of a uint32's 4.
    """
    gaps: np.ndarray = np.diff(index.astype(np.int64), prepend=0)
    escapes, rest = np.divmod(gaps, _ESCAPE)
    out = np.full(int(escapes.sum()) + gaps.size, _ESCAPE, dtype=np.uint8)
    out[np.cumsum(escapes + 1) - 1] = rest
    return out


def decode_gaps(tokens: np.ndarray, k: int, size: int) -> np.ndarray:
    """Decode the ``k`` coordinates :func:`encode_gaps` wrote, checked strictly increasing and below ``size``.

    Raises
    ------
    UpdateRejected
        Another count, a repeated or out-of-range coordinate.
    """
    if tokens.size > k + size // _ESCAPE + 1:  # what k coordinates below size can take at most
        raise UpdateRejected(f"compressed index holds {tokens.size} bytes, more than {k} coordinates below "
                             f"{size} can need")
    ends = tokens != _ESCAPE
    index: np.ndarray = np.cumsum(tokens, dtype=np.int64)[ends]
    if index.size != k or (tokens.size and not ends[-1]):
        raise UpdateRejected(f"compressed index holds {index.size} coordinates, expected {k}")
    if k and (int(index[-1]) >= size or (k > 1 and not bool(np.all(index[1:] > index[:-1])))):
        raise UpdateRejected(f"compressed index must be strictly increasing and below {size}")
    return index


def shared_index(size: int, k: int, seed: int) -> np.ndarray:
    """Draw the round's random-k coordinates: ``k`` of ``range(size)``, sorted, the same for all holders of ``seed``."""
    rng = np.random.default_rng([seed, size, 0x7A11])
    return np.sort(rng.choice(size, size=min(k, size), replace=False)).astype(np.uint32)


@dataclass(frozen=True)
class Codec:
    """One round's uplink encoder chain (see the module docstring).

    Parameters
    ----------
    bits : int
        32 sends float32 values; 1 to 16 quantises them to that many bits.
    topk, randomk : float
        Fraction of coordinates kept, by magnitude or at the round's shared
        coordinates; 0 turns the sparsifier off (at most one of the two).
    error_feedback : bool
        Keep what was not sent on the client and add it to the next update.
    seed : int
        The round's shared seed (random-k's coordinates; the server binds it).
    rescale : bool
        Scale random-k without error feedback by ``d / k`` when decoding.
        ``False`` under DP, where decoding comes before the noise.
    """

    bits: int = 32
    topk: float = 0.0
    randomk: float = 0.0
    error_feedback: bool = True
    seed: int = 0
    rescale: bool = True  # random-k without feedback: by d / k (False under DP: noise comes after decoding)

    def __post_init__(self) -> None:
        """Refuse bits outside 1 to 16 and 32, a fraction outside [0, 1], or both sparsifiers at once."""
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not (1 <= self.bits <= 16
                                                                                or self.bits == 32):
            raise ValueError(f"bits = {self.bits!r}: expected 1 to 16, or 32 (no quantisation)")
        for name in ("topk", "randomk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} = {value!r}: expected a fraction in [0, 1] (0 turns it off)")
        if self.topk and self.randomk:
            raise ValueError("topk and randomk are two sparsifiers: choose one")

    @property
    def active(self) -> bool:
        """Whether this codec changes anything (else the update travels dense, as float32)."""
        return self.bits != 32 or self.topk > 0 or self.randomk > 0

    @property
    def fraction(self) -> float:
        """Share of the coordinates the sparsifier keeps (1.0 when neither top-k nor random-k is on)."""
        return self.topk or self.randomk or 1.0

    def kept(self, size: int) -> int:
        """How many of ``size`` coordinates travel."""
        # rounded first: 0.3 x 10 is 3.0000000000000004 in floats, and keeps 3
        return size if self.fraction >= 1.0 else max(1, min(size, math.ceil(round(self.fraction * size, 9))))

    def to_settings(self) -> dict[Setting[Any], SettingValue]:
        """Return the instruction settings that tell a client this codec (none for dense float32)."""
        return {CODEC_BITS: self.bits, CODEC_TOPK: float(self.topk), CODEC_RANDOMK: float(self.randomk),
                CODEC_FEEDBACK: bool(self.error_feedback), CODEC_SEED: int(self.seed),
                CODEC_RESCALE: bool(self.rescale)} if self.active else {}

    @classmethod
    def from_config(cls, config: TrainConfig) -> Codec | None:
        """Return the codec a round's instruction asks for, or ``None`` (dense float32).

        Raises
        ------
        ValueError
            A malformed value, naming it.
        """
        bits = config.get(CODEC_BITS)
        if bits is None:
            return None
        topk, randomk = config.get(CODEC_TOPK), config.get(CODEC_RANDOMK)
        feedback, seed, rescale = config.get(CODEC_FEEDBACK), config.get(CODEC_SEED), config.get(CODEC_RESCALE)
        return cls(bits=bits, topk=topk or 0.0, randomk=randomk or 0.0,
                   error_feedback=True if feedback is None else feedback, seed=seed or 0,
                   rescale=True if rescale is None else rescale)

    def index(self, vector: np.ndarray) -> np.ndarray | None:
        """Return the coordinates this codec keeps of ``vector`` (``None``: all of them)."""
        k = self.kept(vector.size)
        if k >= vector.size:
            return None
        return top_k_index(vector, k) if self.topk else shared_index(vector.size, k, self.seed)

    def encode(self, vector: np.ndarray, rng: np.random.Generator) -> dict[str, Array]:
        """Compress ``vector`` into the arrays of a compressed update.

        ``values`` (float32), or ``codes`` (the float32 scale ``m``, then the
        packed codes); ``index`` for top-k, its coordinates as byte gaps
        (:func:`encode_gaps`).
        """
        index = self.index(vector)
        values = vector if index is None else vector[index]
        arrays = {"index": typed_array(encode_gaps(index))} if index is not None and self.topk else {}
        if self.bits == 32:
            return {**arrays, "values": typed_array(values.astype(np.float32, copy=False))}
        codes, m = quantize(values, self.bits, rng)
        # the scale rides in the codes' first four bytes: an Array of its own costs ~300 bytes on the wire
        head = np.frombuffer(np.array([m], _F32).tobytes(), dtype=_U8)
        return {**arrays, "codes": typed_array(np.concatenate([head, pack_bits(codes, self.bits)]))}

    def decode(self, arrays: Mapping[str, Any], size: int, max_bytes: int | None = None) -> np.ndarray:
        """Decode the dense float32 update of ``size`` values that ``arrays`` encode (a new buffer).

        Raises
        ------
        UpdateRejected
            Missing or extra arrays, a wrong dtype or length, an index that is
            not strictly increasing within ``size``, a scale that is not
            finite in ``[0, MAX_SCALE]``, or more than ``max_bytes`` in all.
        """
        got = {name: a for name, a in arrays.items()}
        wanted = {"values"} if self.bits == 32 else {"codes"}
        wanted |= {"index"} if self.topk and self.kept(size) < size else set()
        if set(got) != wanted:
            raise UpdateRejected(f"compressed update holds {sorted(got)}, expected {sorted(wanted)}")
        if max_bytes is not None and sum(len(a.data) for a in got.values()) > max_bytes:
            raise UpdateRejected(f"compressed update is over the {max_bytes}-byte limit")
        k = self.kept(size)
        values = self._values(got, k)
        index = decode_gaps(typed_view(got["index"], _U8, "compressed index"), k, size) if self.topk and k < size \
            else None
        return self.scatter(values, size, index)

    def scatter(self, values: np.ndarray, size: int, index: np.ndarray | None = None) -> np.ndarray:
        """Return the dense update of ``size`` values whose kept values are ``values`` (a new float32 buffer).

        ``index``: top-k's received coordinates; random-k's are the round's
        own. Random-k without error feedback is rescaled by ``size / k``
        (unbiased over the draw of coordinates) unless ``rescale`` is off. Also decodes a secure sum of
        random-k vectors, since scattering and rescaling are linear.

        Raises
        ------
        UpdateRejected
            ``values`` is not ``kept(size)`` long.
        """
        k = self.kept(size)
        if values.shape != (k,):
            raise UpdateRejected(f"compressed update holds {values.shape[0]} values, expected {k} of {size}")
        out = np.zeros(size, dtype=np.float32)
        if k >= size:
            out[:] = values
            return out
        out[index if index is not None else shared_index(size, k, self.seed)] = values
        if self.randomk and not self.error_feedback and self.rescale:
            out *= np.float32(size / k)
        return out

    def select(self, vector: np.ndarray, residual: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """Select random-k's kept values for secure aggregation, and the new residual.

        The kept values of ``vector`` (plus the residual, with error feedback)
        as one dense float32 vector, which the protocol masks, and the new
        residual (``None`` without error feedback). :meth:`scatter` decodes
        their secure sum.
        """
        send = vector + residual if self.error_feedback and residual is not None and residual.shape == vector.shape \
            else vector
        index = self.index(send)
        values = np.ascontiguousarray(send if index is None else send[index], dtype=np.float32)
        if not self.error_feedback:
            return values, None
        left = np.array(send, dtype=np.float32)
        left[slice(None) if index is None else index] = 0.0
        return values, left

    def _values(self, got: Mapping[str, Any], k: int) -> np.ndarray:
        if self.bits == 32:
            values = typed_view(got["values"], _F32, "compressed values")
            if values.shape != (k,) or not np.isfinite(values).all():
                raise UpdateRejected(f"compressed values: {values.shape[0]} finite float32 values expected {k}")
            return values
        payload = typed_view(got["codes"], _U8, "compressed codes")
        want = 4 + (k * self.bits + 7) // 8
        if payload.shape != (want,):
            raise UpdateRejected(f"compressed codes: {payload.shape[0]} bytes, expected {want} (a float32 scale, "
                                 f"then {k} values of {self.bits} bits)")
        scale = float(payload[:4].view(_F32)[0])
        if not 0.0 <= scale <= MAX_SCALE:
            raise UpdateRejected(f"compressed scale must be a float32 in [0, {MAX_SCALE:g}], got {scale!r}")
        return dequantize(unpack_bits(payload[4:], self.bits, k), self.bits, scale)

    def error_bound(self, m: float) -> float:
        """Worst-case error of a kept coordinate whose payload's largest magnitude is ``m``."""
        return 0.0 if self.bits == 32 else 2.0 * m / ((1 << self.bits) - 1)


def with_feedback(codec: Codec, delta: np.ndarray, residual: np.ndarray | None,
                  rng: np.random.Generator) -> tuple[dict[str, Array], np.ndarray | None]:
    """Encode ``delta`` plus what earlier rounds did not send; return the arrays and the new residual.

    The residual is ``None`` when error feedback is off. One of the wrong size
    (the model changed) is dropped, not added.
    """
    if not codec.error_feedback:
        return codec.encode(delta, rng), None
    send = delta + residual if residual is not None and residual.shape == delta.shape else delta.copy()
    arrays = codec.encode(send, rng)
    send -= codec.decode(arrays, send.size)
    return arrays, send
