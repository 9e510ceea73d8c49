"""The global model on the way down: float32 as is, float16, or 8-bit per-tensor linear codes.

``[compression] downlink_bits``. A stock Flower client loads float16 tensors
as they are; 8-bit codes are Quorum's client's. Both are rounded
deterministically, so the server knows exactly the model every client starts
from (:meth:`Broadcast.roundtrip`) and makes a full-weight reply a delta
against it. The server keeps its own model in float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array

from core.errors import UpdateRejected
from core.layouts import ParamLayout, typed_array, typed_view

__all__ = ["Broadcast"]

_U8, _F32 = np.dtype(np.uint8), np.dtype("<f4")


@dataclass(frozen=True)
class Broadcast:
    """The global model's precision on the way down: 32 (as is), 16 (float16) or 8 bits.

    8 bits are per-tensor linear codes, round to nearest: ``|w_hat - w| <= (max - min) / 510``
    per tensor; 16 bits are float16, relative error at most ``2^-11`` (values beyond
    float16's range are refused, not clipped).
    """

    bits: int = 32

    def __post_init__(self) -> None:
        """Refuse a precision other than 8, 16 or 32 bits."""
        if self.bits not in (8, 16, 32) or isinstance(self.bits, bool):
            raise ValueError(f"downlink bits = {self.bits!r}: expected 8, 16 or 32")

    def encode(self, params: np.ndarray, layout: ParamLayout) -> dict[str, Array]:
        """Encode the model as named tensors in this precision (what the instruction's ``arrays`` hold).

        Raises
        ------
        ValueError
            A value beyond float16's range under 16 bits.
        """
        arrays, offset = {}, 0
        for name, shape, n in zip(layout.names, layout.shapes, layout.sizes, strict=True):
            part = params[offset:offset + n].reshape(shape)
            offset += n
            if self.bits == 8:
                lo, step, codes = _linear8(part)
                arrays[name] = typed_array(codes)
                arrays[f"{name}@range"] = typed_array(np.array([lo, step], dtype=_F32))
                continue
            if self.bits == 16 and part.size and float(np.max(np.abs(part))) > 65504.0:
                raise ValueError(f"tensor {name!r} holds values beyond float16's range: use downlink bits 32")
            arrays[name] = typed_array(part.astype(np.float16 if self.bits == 16 else np.float32))
        return arrays

    def decode(self, arrays: Mapping[str, Any], layout: ParamLayout) -> np.ndarray:
        """Return the flat float32 model ``arrays`` hold (8-bit codes decoded; floats of any width cast).

        Raises
        ------
        UpdateRejected
            Missing tensors, wrong shapes or dtypes, a non-finite range.
        """
        out, offset = np.empty(layout.size, dtype=np.float32), 0
        for name, shape, n in zip(layout.names, layout.shapes, layout.sizes, strict=True):
            if name not in arrays or f"{name}@range" not in arrays:
                raise UpdateRejected(f"8-bit global model lacks tensor {name!r} or its range")
            codes = typed_view(arrays[name], _U8, f"global model tensor {name!r}")
            bounds = typed_view(arrays[f"{name}@range"], _F32, "tensor range")
            lo, step = (float(bounds[0]), float(bounds[-1])) if bounds.size == 2 else (math.nan, math.nan)
            if codes.size != n or not (math.isfinite(lo) and math.isfinite(step) and step >= 0):
                raise UpdateRejected(f"8-bit global model tensor {name!r}: {codes.size} codes, expected {n} "
                                     f"{shape}, with a finite range")
            out[offset:offset + n] = (codes.reshape(-1).astype(np.float64) * step + lo).astype(np.float32)
            offset += n
        return out

    def roundtrip(self, params: np.ndarray, layout: ParamLayout) -> np.ndarray:
        """Exactly the model a client decodes from this broadcast (what its delta is relative to)."""
        if self.bits == 32:
            return params
        if self.bits == 16:
            return params.astype(np.float16).astype(np.float32)
        return self.decode(self.encode(params, layout), layout)


def _linear8(part: np.ndarray) -> tuple[float, float, np.ndarray]:
    lo, hi = (float(part.min()), float(part.max())) if part.size else (0.0, 0.0)
    step = (hi - lo) / 255.0
    if step == 0.0:
        return lo, 0.0, np.zeros(part.shape, dtype=np.uint8)
    # float32 lo/step are what travel: round with them, so the server's roundtrip equals the client's decode
    lo32, step32 = float(np.float32(lo)), float(np.float32(step))
    codes = np.clip(np.rint((part.astype(np.float64) - lo32) / step32), 0, 255).astype(np.uint8)
    return lo32, step32, codes
