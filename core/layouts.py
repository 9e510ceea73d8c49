"""How a model's numbers travel: one flat float32 buffer, or the same numbers as named tensors.

The aggregator works on one flat float32 buffer per model; Flower's message
API carries a model as an ``ArrayRecord`` shaped like a torch ``state_dict``
(one ``Array`` per named tensor). A :class:`ParamLayout` (the names and shapes,
in the order of the flat buffer) converts between the two with one copy each
way: :func:`encode_named` slices the buffer into ``.npy`` payloads,
:func:`gather` concatenates received tensors into one new flat buffer. Message
keys are the wire format's business (:mod:`core.instructions`, :mod:`core.replies`); nothing here names one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import numpy as np
from flwr.app import Array

from core.aggregate import all_finite
from core.boundary import one_line
from core.errors import UpdateRejected

__all__ = ["ParamLayout", "npy_bytes", "npy_view", "typed_array", "typed_view", "encode_named", "gather", "FLAT_NAME"]

#: The one tensor name of a layout that knows no tensor names (a bare flat buffer).
FLAT_NAME = "params"
#: The largest integer size float32 holds exactly (every integer of at most 2^24 in size).
FLOAT32_EXACT_INT = 2**24


@dataclass(frozen=True)
class ParamLayout:
    """The tensors a flat buffer holds: their names and shapes, in buffer order.

    Built from a torch model's ``state_dict`` by ``learning.models.layout_of``;
    the aggregator sends the global model in this layout, so a stock Flower
    client can ``load_state_dict`` it, and reads Flower-layout replies back by
    these names.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        """Refuse a layout without exactly one shape per distinct name."""
        if len(self.names) != len(self.shapes) or len(set(self.names)) != len(self.names):
            raise ValueError(f"a layout needs one shape per distinct name, got {len(self.names)} names "
                             f"({len(set(self.names))} distinct) and {len(self.shapes)} shapes")

    @classmethod
    def of(cls, shapes: Mapping[str, Sequence[int]]) -> ParamLayout:
        """Build the layout of ``{name: shape}`` in its iteration order."""
        return cls(tuple(shapes), tuple(tuple(int(d) for d in s) for s in shapes.values()))

    @classmethod
    def flat(cls, size: int) -> ParamLayout:
        """Build a one-tensor layout for a buffer whose tensor names are unknown."""
        return cls((FLAT_NAME,), ((int(size),),))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Scalars in each tensor, in layout order."""
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        """Scalars in all tensors: the length of the flat buffer."""
        return sum(self.sizes)

    def describe(self, limit: int = 3) -> str:
        """``'0.weight' (16, 1, 5, 5), '0.bias' (16,), ... (8 tensors, 12,345 values)``, for error messages."""
        shown = ", ".join(f"{n!r} {s}" for n, s in zip(self.names[:limit], self.shapes[:limit], strict=True))
        more = ", ..." if len(self.names) > limit else ""
        return f"{shown}{more} ({len(self.names)} tensors, {self.size:,} values)"


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` as ``.npy`` bytes (what ``np.save`` writes), with one copy of its data."""
    array = np.ascontiguousarray(array)
    header = BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return b"".join((header.getvalue(), array.reshape(-1).data.cast("B")))


#: Parsed ``.npy`` headers by their exact bytes: every message of a round carries the same few
#: (numpy parses one with ``ast.literal_eval``, about 50 us, twice per tensor and message otherwise).
_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}
_HEADERS_MAX, _HEADER_BYTES_MAX = 512, 4096


def _npy_header(data: bytes, what: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, offset of the values) of a ``.npy`` payload's header."""
    end = _header_end(data)
    key = bytes(data[:end]) if end is not None else None
    if key is not None and (hit := _HEADERS.get(key)) is not None:
        return (*hit, len(key))
    stream = BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                  else np.lib.format.read_array_header_2_0)
        shape, fortran, found_dtype = reader(stream)
    except Exception as exc:  # numpy's header parser raises ValueError, TokenError, SyntaxError, ... on junk
        raise UpdateRejected(f"{what} is not a valid .npy buffer: {one_line(exc)}") from None
    parsed = (tuple(shape), bool(fortran), np.dtype(found_dtype))
    if key is not None and stream.tell() == len(key):
        if len(_HEADERS) >= _HEADERS_MAX:
            _HEADERS.clear()
        _HEADERS[key] = parsed
    return (*parsed, stream.tell())


def _header_end(data: bytes) -> int | None:
    """Where a ``.npy`` header of version 1, 2 or 3 ends (by its length field), if it is short enough to cache."""
    if len(data) < 12 or data[:6] != b"\x93NUMPY":
        return None
    major = data[6]
    end = 10 + int.from_bytes(data[8:10], "little") if major == 1 else \
        12 + int.from_bytes(data[8:12], "little") if major in (2, 3) else None
    return end if end is not None and end <= min(len(data), _HEADER_BYTES_MAX) else None


def npy_view(data: bytes, what: str = "update", dtype: np.dtype | None = None) -> np.ndarray:
    """Return a read-only view of a ``.npy`` payload: no copy, never unpickled.

    The payload must hold floats of any width (float16/32/64), or integers (a
    BatchNorm's ``num_batches_tracked``: :func:`gather` checks that float32
    holds them exactly), in C or Fortran
    order (scikit-learn's ``coef_`` is Fortran-ordered float64): a Fortran
    payload comes back as the transposed view of its bytes, so its shape and
    indexing are the array's own. With ``dtype`` (a compressed update's codes
    and indices, :mod:`core.compress`) the payload must be exactly that dtype,
    in C order.

    Raises
    ------
    UpdateRejected
        Not a ``.npy`` buffer, another dtype (or Fortran order with ``dtype``), or truncated.
    """
    shape, fortran, found, offset = _npy_header(data, what)
    if found.kind not in "fiu" if dtype is None else (found != dtype or fortran):
        raise UpdateRejected(f"{what} is {found} {'(Fortran order) ' if fortran else ''}data, "
                             f"expected {'floats or integers' if dtype is None else f'C-ordered {np.dtype(dtype)}'}")
    count = math.prod(shape)
    if len(data) - offset != count * found.itemsize:
        raise UpdateRejected(f"{what} payload is truncated or padded")
    values = np.frombuffer(data, dtype=found, count=count, offset=offset)
    return values.reshape(shape[::-1]).T if fortran else values.reshape(shape)


def typed_array(values: np.ndarray) -> Array:
    """Wrap ``values`` as a Flower ``Array`` of their own dtype (``.npy`` bytes).

    For a compressed update's codes, coordinates or values, and a broadcast's
    tensors.
    """
    values = np.ascontiguousarray(values)
    return Array(dtype=str(values.dtype), shape=tuple(values.shape), stype="numpy.ndarray", data=npy_bytes(values))


def typed_view(array: Any, dtype: np.dtype, what: str) -> np.ndarray:
    """Return a flat read-only view of an untrusted ``Array`` that must hold exactly ``dtype``.

    Raises
    ------
    UpdateRejected
        Not a numpy ``Array``, or :func:`npy_view` refuses its payload.
    """
    if not isinstance(array, Array) or array.stype != "numpy.ndarray":
        raise UpdateRejected(f"{what} is not a numpy Array")
    data = array.data if isinstance(array.data, bytes) else bytes(array.data)
    return npy_view(data, what, dtype).reshape(-1)


def encode_named(flat: np.ndarray, layout: ParamLayout) -> dict[str, Array]:
    """Slice ``flat`` into one ``.npy`` ``Array`` per tensor of ``layout`` (one copy of the model in all).

    Raises
    ------
    ValueError
        ``flat`` does not hold ``layout.size`` values.
    """
    flat = np.ascontiguousarray(flat, dtype=np.float32).reshape(-1)
    if flat.size != layout.size:
        raise ValueError(f"the model buffer holds {flat.size} values; the layout {layout.describe()} needs "
                         f"{layout.size}")
    arrays, offset = {}, 0
    for name, shape, n in zip(layout.names, layout.shapes, layout.sizes, strict=True):
        part = flat[offset:offset + n].reshape(shape)
        arrays[name] = Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=npy_bytes(part))
        offset += n
    return arrays


def gather(tensors: Sequence[tuple[str, Array]], layout: ParamLayout, what: str = "update", *,
           check_finite: bool = True) -> np.ndarray:
    """Concatenate ``tensors`` (``layout``'s, in its order) into one new flat float32 buffer.

    Each payload is parsed by :func:`npy_view` (any float dtype, C or Fortran
    order, cast and reordered while copying: the one conversion it costs); its
    shape must be the layout's. An integer tensor (a BatchNorm's
    ``num_batches_tracked``) joins as floats, averaged like the rest, if
    every value is at most 2^24 in size (float32 holds it exactly). A float64 value beyond float32's range becomes
    an infinity here, and is refused as one. This is the one copy a named
    reply costs before it joins the flat-buffer aggregation path.
    ``check_finite=False`` leaves the NaN / Inf scan to a caller that scans
    what it computes from the buffer anyway (a NaN or an infinity survives
    subtracting finite numbers).

    Raises
    ------
    UpdateRejected
        A count, shape or dtype that does not match, or NaN / Inf values.
    """
    if len(tensors) != len(layout.names):
        raise UpdateRejected(f"{what} has {len(tensors)} tensors, expected {layout.describe()}")
    out = np.empty(layout.size, dtype=np.float32)
    offset = 0
    for (name, array), shape, n in zip(tensors, layout.shapes, layout.sizes, strict=True):
        data = array.data if isinstance(array.data, bytes) else bytes(array.data)
        view = npy_view(data, f"{what} tensor {name!r}")
        if view.shape != shape:
            raise UpdateRejected(f"{what} tensor {name!r} has shape {view.shape}, expected {shape}")
        if view.dtype.kind in "iu" and view.size and max(-int(view.min()), int(view.max())) > FLOAT32_EXACT_INT:
            raise UpdateRejected(f"{what} tensor {name!r} is {view.dtype} with a value beyond 2^24, which the "
                                 "float32 model does not hold exactly")
        with np.errstate(over="ignore"):  # a float64 beyond float32's range: an infinity, refused below
            out[offset:offset + n].reshape(shape)[...] = view  # C order whatever the payload's, one copy
        offset += n
    if check_finite and not all_finite(out):
        raise UpdateRejected(f"{what} holds NaN or Inf values")
    return out
