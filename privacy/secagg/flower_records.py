"""How protocol messages ride inside Flower ``RecordDict`` s.

Every stage message carries a ConfigRecord named ``"secagg"`` with
``"stage"`` (the :class:`Stage` value: what fault injectors and the client mod
look at), ``"round"`` and ``"payload"`` (the canonical encoding of the
message). The masked vector travels as an ``ArrayRecord`` (Flower chunks large
arrays), named ``"secagg.masked"``.
"""

from __future__ import annotations

import io
from typing import TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from numpy.lib import format as npy

from core.boundary import one_line, rejects_any
from privacy.secagg.codec import decode, encode
from privacy.secagg.errors import SecAggProtocolError
from privacy.secagg.messages import REPLY_TYPES, REQUEST_TYPES, MaskedInput, Reply, Request
from privacy.secagg.stage import Stage

__all__ = [
    "MASKED_RECORD",
    "METRICS_FLAG",
    "metrics_wanted",
    "array_of",
    "ndarray_of",
    "RECORD",
    "STATE_RECORD",
    "content_bytes",
    "read_reply",
    "read_request",
    "record_of",
    "reply_content",
    "request_content",
]

R = TypeVar("R", ArrayRecord, ConfigRecord, MetricRecord)

RECORD = "secagg"
STATE_RECORD = "secagg.state"
MASKED_RECORD = "secagg.masked"
METRICS_FLAG = "client-metrics"
_VECTOR = "vector"


def array_of(vector: np.ndarray) -> Array:
    """``Array(vector)`` with one copy instead of ``np.save``'s three (same bytes)."""
    vector = np.ascontiguousarray(vector)
    header = io.BytesIO()
    npy.write_array_header_1_0(header, npy.header_data_from_array_1_0(vector))
    return Array(dtype=str(vector.dtype), shape=tuple(vector.shape), stype="numpy.ndarray",
                 data=b"".join([header.getvalue(), vector.data.cast("B")]))


def ndarray_of(array: Array, strict: bool = False) -> np.ndarray:
    """Return a read-only, zero-copy view of a 1-D numeric ``Array``; otherwise ``array.numpy()``.

    ``strict`` (a client's bytes, read on the server): anything but a 1-D,
    C-ordered, non-object ``.npy`` vector raises ``ValueError`` with the
    reason, and ``array.numpy()`` (which allocates the shape a header claims)
    is never called.
    """
    try:
        shape, _, dtype, offset = _vector_header(array.data)
    except ValueError:
        if strict:
            raise
        return array.numpy()
    return np.frombuffer(array.data, dtype=dtype, count=shape[0], offset=offset)


def _vector_header(data: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran order, dtype, offset) of a 1-D numeric ``.npy`` payload; ``ValueError`` otherwise."""
    fp = io.BytesIO(data[:4096])
    try:
        version = npy.read_magic(fp)
        read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        shape, fortran, dtype = read(fp)
    except Exception as exc:  # numpy's header parser raises ValueError, TokenError, SyntaxError, ... on junk
        raise ValueError(f"not a .npy buffer: {one_line(exc)}") from None
    if len(shape) != 1 or fortran or dtype.hasobject:
        raise ValueError(f"a {dtype} array of shape {shape}{' in Fortran order' if fortran else ''}, "
                         "expected a 1-D vector")
    return shape, fortran, dtype, fp.tell()


def record_of(content: RecordDict, name: str, kind: type[R]) -> R | None:
    """``content[name]`` if it is a ``kind`` record, else None.

    Direct access: Flower's ``content.config_records`` view rebuilds (and
    re-assigns) every record on each call.
    """
    value = content.get(name)
    return value if isinstance(value, kind) else None


def _header(stage: Stage, round_id: int, payload: bytes) -> ConfigRecord:
    return ConfigRecord({"stage": stage.value, "round": round_id, "payload": payload})


def request_content(stage: Stage, round_id: int, request: Request,
                    extra: RecordDict | None = None, client_metrics: bool = True) -> RecordDict:
    """Content of the server's message for ``stage`` (``extra`` records are kept).

    The MASKED_INPUT header also says whether the client should send its
    training metrics back in clear (``client_metrics``).
    """
    records = dict(extra.items()) if extra is not None else {}
    header = _header(stage, round_id, encode(request))
    if stage is Stage.MASKED_INPUT:
        header[METRICS_FLAG] = client_metrics
    records[RECORD] = header
    return RecordDict(records)


def metrics_wanted(content: RecordDict) -> bool:
    """Whether a MASKED_INPUT request asks for the client's metrics in clear (default: yes)."""
    header = record_of(content, RECORD, ConfigRecord)
    return header is None or header.get(METRICS_FLAG, True) is not False


def _stage_of(content: RecordDict) -> tuple[Stage, int, bytes]:
    header = record_of(content, RECORD, ConfigRecord)
    try:
        if header is None:
            raise KeyError(RECORD)
        stage = Stage(header["stage"])
        round_id, payload = header["round"], header["payload"]
    except (KeyError, ValueError) as exc:
        raise SecAggProtocolError("malformed secure-aggregation header") from exc
    if not isinstance(round_id, int) or not isinstance(payload, bytes):
        raise SecAggProtocolError("malformed secure-aggregation header")
    return stage, round_id, payload


def read_request(content: RecordDict) -> tuple[Stage, int, Request]:
    """Parse a server message: ``(stage, round, request)``."""
    stage, round_id, payload = _stage_of(content)
    return stage, round_id, decode(payload, REQUEST_TYPES[stage])


def reply_content(stage: Stage, round_id: int, reply: Reply,
                  extra: RecordDict | None = None) -> RecordDict:
    """Content of a client's reply; a masked vector goes in an ArrayRecord."""
    records = dict(extra.items()) if extra is not None else {}
    if isinstance(reply, MaskedInput):
        records[MASKED_RECORD] = ArrayRecord({_VECTOR: array_of(reply.vector)})
        payload = b""
    else:
        payload = encode(reply)
    records[RECORD] = _header(stage, round_id, payload)
    return RecordDict(records)


@rejects_any("secure-aggregation reply", SecAggProtocolError)
def read_reply(expected: Stage, round_id: int, content: RecordDict) -> Reply:
    """Parse a client reply for ``expected`` stage of round ``round_id``.

    Raises
    ------
    SecAggProtocolError
        The reply is for another stage or round, or malformed; whatever a
        parser raises on its bytes becomes this error, with the reason
        (:func:`core.boundary.rejects_any`).
    """
    stage, got_round, payload = _stage_of(content)
    if stage is not expected or got_round != round_id:
        raise SecAggProtocolError(f"reply for {stage.value}/{got_round}, expected {expected.value}/{round_id}")
    if stage is not Stage.MASKED_INPUT:
        return decode(payload, REPLY_TYPES[stage])
    arrays = record_of(content, MASKED_RECORD, ArrayRecord)
    try:
        if arrays is None:
            raise KeyError(MASKED_RECORD)
        vector = ndarray_of(arrays[_VECTOR], strict=True)
    except (KeyError, TypeError, ValueError) as exc:
        raise SecAggProtocolError(f"malformed masked input: {one_line(exc)}") from exc
    return MaskedInput(vector)


def content_bytes(content: RecordDict) -> int:
    """Protocol bytes in a content: the header payload and any masked vector."""
    header = record_of(content, RECORD, ConfigRecord)
    arrays = record_of(content, MASKED_RECORD, ArrayRecord)
    payload = header.get("payload", b"") if header is not None else b""
    total = len(payload) if isinstance(payload, bytes) else 0
    return total + (sum(len(a.data) for a in arrays.values()) if arrays is not None else 0)
