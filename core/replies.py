"""Train and evaluate replies: encoded on the client, decoded and validated on the aggregator.

Half of the wire format (the instructions are :mod:`core.instructions`, the
evaluate replies :mod:`core.eval_replies`). A client answers
in the layout its instruction came in (:class:`~core.instructions.Wire`). A
Quorum update travels as one flat float32 ``Array`` (numpy ``.npy`` bytes,
never pickle) and is decoded without copying; a Flower reply's full weights
(``arrays``, or a legacy ``fitres.parameters``) are gathered into one flat
buffer and made a delta against the global model sent. Every reply is
validated before anything touches the running aggregate: a malformed one
raises :class:`~core.errors.UpdateRejected` naming the problem, and the
figures a client reports are bounded (:data:`MAX_EXAMPLES`, :data:`MAX_LOSS`,
:func:`clean_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, MetricRecord, RecordDict

from core.aggregate import all_finite
from core.boundary import rejects_any
from core.compress import Codec
from core.errors import UpdateRejected
from core.instructions import Instruction, Wire
from core.layouts import ParamLayout, encode_named, gather, npy_bytes, npy_view

__all__ = [
    "TrainReply", "encode_flat", "decode_flat", "train_reply", "parse_train_reply", "clean_metrics", "MAX_EXAMPLES",
    "MAX_LOSS", "MAX_METRICS", "MAX_METRIC_VALUE",
    "MAX_KEY_CHARS", "own_update", "rewrite_update", "REFUSAL_CODE", "refusal", "refusal_reason",
]


@dataclass(frozen=True)
class TrainReply:
    """A decoded train reply: the update as a delta, its example count, its metrics and the wire layout it came in."""

    delta: np.ndarray
    num_examples: int
    metrics: dict[str, float]
    wire: Wire = Wire.QUORUM


def encode_flat(vector: np.ndarray) -> Array:
    """One flat float32 buffer as a Flower ``Array`` (``.npy`` bytes, as ``np.save`` writes them)."""
    flat = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
    # one copy into bytes of the exact size (np.save into a BytesIO grows a buffer, then copies it)
    return Array(dtype="float32", shape=(int(flat.shape[0]),), stype="numpy.ndarray", data=npy_bytes(flat))


def decode_flat(array: Array, size: int | None = None, max_bytes: int | None = None) -> np.ndarray:
    """Decode a flat float ``Array``, validating it fully.

    A float32 one without copying, a float16 or float64 one converted once to
    float32 (a value beyond float32's range is an infinity, refused).

    Raises
    ------
    UpdateRejected
        Wrong serialisation, dtype, shape or size, oversized, NaN or Inf.
    """
    data = array.data
    if max_bytes is not None and len(data) > max_bytes:
        raise UpdateRejected(f"update is {len(data)} bytes, over the {max_bytes}-byte limit")
    if array.stype != "numpy.ndarray" or array.dtype not in _FLOAT_DTYPES:
        raise UpdateRejected(f"update is {array.stype}/{array.dtype}, expected numpy.ndarray/float32 "
                             "(or float16, float64)")
    if len(array.shape) != 1 or (size is not None and array.shape[0] != size):
        raise UpdateRejected(f"update shape is {tuple(array.shape)}, expected ({size},)")
    vector = _npy_view(bytes(data) if not isinstance(data, bytes) else data)
    if vector.shape[0] != array.shape[0]:
        raise UpdateRejected("update bytes do not match the declared shape")
    if not all_finite(vector):
        raise UpdateRejected("update holds NaN or Inf values")
    return vector


_FLOAT_DTYPES = ("float16", "float32", "float64")


def _npy_view(data: bytes) -> np.ndarray:
    view = npy_view(data)  # a view, never unpickled; refuses a bad header, a wrong length, neither float nor int
    if view.dtype.name not in _FLOAT_DTYPES or view.ndim != 1:
        raise UpdateRejected(f"update payload is {view.dtype} {view.shape}, expected 1-D float32")
    if view.dtype == np.float32:
        return view
    with np.errstate(over="ignore"):  # beyond float32's range: an infinity, refused by the caller's scan
        return view.astype(np.float32)


def train_reply(delta: np.ndarray, num_examples: int, metrics: dict[str, float],
                answer_to: Instruction | None = None, compressed: Mapping[str, Array] | None = None) -> RecordDict:
    """Build a train reply.

    Quorum's delta (or its ``compressed`` arrays,
    :meth:`core.compress.Codec.encode`), or (``answer_to`` a Flower
    instruction) the full weights in the layout and tensor names the server
    used, as Flower's strategies expect them.
    """
    if answer_to is None or answer_to.wire is Wire.QUORUM:
        return RecordDict({
            "update": ArrayRecord(dict(compressed) if compressed is not None else {"delta": encode_flat(delta)}),
            "metrics": MetricRecord({"num-examples": int(num_examples), **metrics}),
        })
    weights = encode_named(answer_to.params + delta, answer_to.layout)
    loss = {"train_loss": float(metrics["train-loss"])} if "train-loss" in metrics else {}
    if answer_to.wire is Wire.FLOWER:
        return RecordDict({"arrays": ArrayRecord(weights),
                           "metrics": MetricRecord({**loss, "num-examples": int(num_examples)})})
    return RecordDict({
        "fitres.parameters": ArrayRecord({str(i): a for i, a in enumerate(weights.values())}),
        "fitres.num_examples": MetricRecord({"num_examples": int(num_examples)}),
        "fitres.metrics": ConfigRecord(dict(loss)), "fitres.status": _LEGACY_OK})


_LEGACY_OK = ConfigRecord({"code": 0, "message": "Success"})


def own_update(content: RecordDict) -> np.ndarray | None:
    """Return the dense delta of a train reply this client built in Quorum's layout; ``None`` for any other.

    For a ClientApp mod that rewrites its own node's update after training (``clients.mods``): the bytes are
    this process's own, so they are read as they are, not validated as a client's.
    """
    record = content.get("update") if isinstance(content, RecordDict) else None
    array = record.get("delta") if isinstance(record, ArrayRecord) else None
    return np.asarray(array.numpy(), dtype=np.float32).reshape(-1) if isinstance(array, Array) else None


def rewrite_update(content: RecordDict, delta: np.ndarray | None = None,
                   compressed: Mapping[str, Array] | None = None, metrics: Mapping[str, float] | None = None) -> None:
    """Replace a Quorum train reply's update (a dense ``delta`` or a codec's ``compressed`` arrays); add ``metrics``.

    The reply is changed in place, as :func:`train_reply` would have built it with these values.
    """
    if compressed is not None:
        content["update"] = ArrayRecord(dict(compressed))
    elif delta is not None:
        content["update"] = ArrayRecord({"delta": encode_flat(delta)})
    if metrics:
        record = content["metrics"]
        if not isinstance(record, MetricRecord):
            raise TypeError(f"reply 'metrics' is a {type(record).__name__}, expected a MetricRecord")
        for key, value in metrics.items():
            record[key] = value


#: The error code of a device's refusal under its own site policy (``clients.policy``): none of Flower's
#: (``flwr.common.constant.ErrorCode``, 0 to 8), so no crash, lost node or raised task reads as one.
REFUSAL_CODE = 4030
_REFUSED = "refused by site policy: "


def refusal(reason: str) -> Error:
    """Return the error reply of a device that refuses a message under its site policy: ``reason`` names the rule.

    An error reply, not content: every workflow (plain, secure aggregation,
    evaluation, FedBuff) reads it where it reads a client's error, before any
    update is parsed, and no mod of the device (DP, compression, secure
    aggregation's masking) can mistake it for an update.
    """
    return Error(code=REFUSAL_CODE, reason=_REFUSED + " ".join(reason.split()))


def refusal_reason(error: Error) -> str | None:
    """Return the rule a refusal names (:func:`refusal`), or ``None`` for any other error."""
    if getattr(error, "code", None) != REFUSAL_CODE:  # an error without a code is no refusal either
        return None
    reason = str(error.reason)
    return reason[len(_REFUSED):] if reason.startswith(_REFUSED) else reason


#: The most examples one client may claim: beyond it a reply is refused, so a
#: count can neither overflow a float weight nor a 64-bit store column.
MAX_EXAMPLES = 10**9
#: The largest loss accepted from a client (finite and non-negative below it).
MAX_LOSS = 1e9
#: Client metrics kept per reply, and the magnitude a kept value may have.
MAX_METRICS, MAX_METRIC_VALUE, MAX_KEY_CHARS = 32, 1e15, 64
_BOUNDED = {"train-loss": (0.0, MAX_LOSS), "duration-s": (0.0, 1e7)}


def _metrics(content: RecordDict) -> dict[str, Any]:
    record = content.get("metrics") if isinstance(content, RecordDict) else None
    if record is None:
        raise UpdateRejected("reply has no 'metrics' record")
    if not isinstance(record, MetricRecord):
        raise UpdateRejected(f"reply 'metrics' is a {type(record).__name__}, expected a MetricRecord")
    return dict(record)


def _num_examples(metrics: dict[str, Any], key: str = "num-examples") -> int:
    n = metrics.get(key)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= MAX_EXAMPLES:
        raise UpdateRejected(f"{key} must be an integer in [1, {MAX_EXAMPLES}], got {n!r}")
    return n


def _in_range(value: Any, low: float, high: float) -> TypeGuard[float]:
    """Whether ``value`` is a real number (not a bool) in ``[low, high]``; NaN never is."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def clean_metrics(metrics: dict[str, Any]) -> dict[str, int | float]:
    """Return the client metrics fit to store and show: numbers within bounds, short keys, a few of them.

    Anything else (lists, NaN, infinities, huge values, a ``train-loss`` or
    ``duration-s`` out of range) is dropped, so no client figure reaches
    arithmetic, the store or a page unbounded.
    """
    kept: dict[str, int | float] = {}
    for key, value in metrics.items():
        low, high = _BOUNDED.get(key, (-MAX_METRIC_VALUE, MAX_METRIC_VALUE))
        if len(kept) < MAX_METRICS and len(key) <= MAX_KEY_CHARS and _in_range(value, low, high):
            kept[key] = value
    return kept


def _typed(content: RecordDict, key: str, kind: type[Any]) -> Any:
    record = content.get(key)
    if not isinstance(record, kind):
        raise UpdateRejected(f"reply {key!r} is a {type(record).__name__}, expected a {kind.__name__}")
    return record


def _legacy_status(content: RecordDict, prefix: str) -> None:
    status = content.get(f"{prefix}.status")
    if isinstance(status, ConfigRecord) and status.get("code", 0) != 0:
        raise UpdateRejected(f"legacy client reported status {status.get('code')!r}: "
                             f"{str(status.get('message', ''))[:200]}")


#: A Flower app's training loss under Quorum's name: ``train_loss``, else quickstart-sklearn's ``train_logloss``.
_TRAIN_LOSS_NAMES = {"train_logloss": "train-loss", "train_loss": "train-loss"}


def _renamed(metrics: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``metrics`` with Flower's names (``train_loss``) also under Quorum's (``train-loss``)."""
    return {**{ours: metrics[theirs] for theirs, ours in names.items() if theirs in metrics}, **metrics}


def _parse_weights(content: RecordDict, size: int, max_bytes: int, reference: np.ndarray | None,
                   layout: ParamLayout | None) -> TrainReply:
    """Read a Flower or legacy reply: full weights, made a delta against ``reference`` (the model sent)."""
    wire = Wire.FLOWER if "arrays" in content else Wire.LEGACY
    if reference is None:
        raise UpdateRejected(f"a {wire.value}-layout reply carries full weights; this workflow takes deltas only")
    layout = layout or ParamLayout.flat(reference.size)
    if size != layout.size:
        raise UpdateRejected(f"this round takes {size} values per update; a {wire.value}-layout reply carries the "
                             f"model's {layout.size} (DP needs Quorum's layout: a delta named 'update')")
    if wire is Wire.FLOWER:
        record, metrics = _typed(content, "arrays", ArrayRecord), _metrics(content)
        n = _num_examples(metrics)
        if set(record) != set(layout.names):
            unknown = sorted(set(record) - set(layout.names))[:3]
            raise UpdateRejected(f"reply 'arrays' hold {len(record)} tensors (unexpected: {unknown}); expected "
                                 f"the model's state_dict: {layout.describe()}")
        tensors = [(name, record[name]) for name in layout.names]
    else:
        _legacy_status(content, "fitres")
        record = _typed(content, "fitres.parameters", ArrayRecord)
        n = _num_examples(dict(_typed(content, "fitres.num_examples", MetricRecord)), "num_examples")
        extra = content.get("fitres.metrics")
        metrics = dict(extra) if isinstance(extra, ConfigRecord) else {}
        tensors = [(k, a) for k, a in record.items() if k != "_empty"]
    nbytes = sum(len(a.data) for _, a in tensors)
    if nbytes > max_bytes:
        raise UpdateRejected(f"update is {nbytes} bytes, over the {max_bytes}-byte limit")
    delta = gather(tensors, layout, check_finite=False)  # NaN / Inf survive the subtraction: scanned once, below
    delta -= reference  # in place: the one flat buffer this reply costs
    if not all_finite(delta):
        raise UpdateRejected("update holds NaN or Inf values")
    return TrainReply(delta, n, clean_metrics(_renamed(metrics, _TRAIN_LOSS_NAMES)), wire)


_LAYOUTS = ("reply has no 'update'/'delta' array (Quorum's layout: a flat float32 delta), no 'arrays' (Flower's: "
            "the model's state_dict, with 'num-examples' in its 'metrics' MetricRecord) and no "
            "'fitres.parameters' (a legacy NumPyClient's)")


def _update_array(content: RecordDict) -> Array:
    record = content.get("update")
    if record is None:
        raise UpdateRejected("reply has no 'update'/'delta' array")
    if not isinstance(record, ArrayRecord):
        raise UpdateRejected(f"reply 'update' is a {type(record).__name__}, expected an ArrayRecord")
    array = record.get("delta")
    if not isinstance(array, Array):
        raise UpdateRejected("reply has no 'update'/'delta' array")
    return array


@rejects_any("train reply")
def parse_train_reply(content: RecordDict, size: int, max_bytes: int, *, reference: np.ndarray | None = None,
                      layout: ParamLayout | None = None, codec: Codec | None = None) -> TrainReply:
    """Decode and validate a train reply in whichever layout it came (see :class:`Wire`).

    A Quorum reply's delta is a view on the message (:func:`decode_flat`); a
    Flower or legacy reply's full weights are gathered by ``layout`` (the names
    and shapes sent) into one new flat buffer and made a delta against
    ``reference``, the global model the server sent.

    Raises
    ------
    UpdateRejected
        A reply in no known layout (the reason names the three), a record of the
        wrong type, an example count outside ``[1, MAX_EXAMPLES]``, tensors that
        do not match ``layout``, or an update :func:`decode_flat` refuses.
        Metrics out of range are dropped. With ``codec`` (the round asked for
        compressed updates) a Quorum update without ``delta`` is decoded by it,
        the server's own codec (:meth:`core.compress.Codec.decode`); a dense
        ``delta`` is still accepted. Anything else a parser raises on the
        reply's bytes (numpy's ``TokenError`` on a ``.npy`` header, say) is
        turned into this rejection by the boundary, :func:`core.boundary.rejects_any`.
    """
    if not isinstance(content, RecordDict) or not any(k in content for k in ("update", "arrays", "fitres.parameters")):
        got = sorted(content) if isinstance(content, RecordDict) else type(content).__name__
        raise UpdateRejected(f"{_LAYOUTS}; got {got}")
    if "update" not in content:
        return _parse_weights(content, size, max_bytes, reference, layout)
    metrics = _metrics(content)
    n = _num_examples(metrics)
    record = content.get("update")
    if codec is not None and isinstance(record, ArrayRecord) and "delta" not in record:
        return TrainReply(codec.decode(record, size, max_bytes), n, clean_metrics(metrics))
    return TrainReply(decode_flat(_update_array(content), size, max_bytes), n, clean_metrics(metrics))
