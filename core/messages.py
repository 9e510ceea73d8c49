"""The messages between aggregator and clients, as typed dataclasses.

Flower carries ``RecordDict`` s; this module is the one place that knows how a
Quorum instruction or reply is laid out in one, so both sides import it. A
model or an update travels as one flat float32 ``Array`` (numpy ``.npy``
bytes, never pickle). Replies are decoded without copying and validated before
anything touches the running aggregate: a malformed reply raises
:class:`~core.errors.UpdateRejected` naming the problem.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypeGuard

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.app.typing import MetricRecordValues

from core.aggregate import all_finite
from core.errors import UpdateRejected

__all__ = [
    "TrainConfig", "TrainReply", "EvalReply", "encode_flat", "decode_flat",
    "train_instruction", "parse_instruction", "train_reply", "parse_train_reply",
    "eval_reply", "parse_eval_reply", "content_bytes", "client_seed", "clean_metrics", "MAX_EXAMPLES",
    "MAX_LOSS",
]


def client_seed(seed: int, server_round: int, node: int) -> int:
    """The training seed of ``node`` in ``server_round``: independent streams per
    (run seed, round, node), so a resumed run trains exactly as an uninterrupted one."""
    return int(np.random.SeedSequence([seed, server_round, node]).generate_state(1)[0] & 0x7FFFFFFF)


@dataclass(frozen=True)
class TrainConfig:
    """What a client needs to train one round (``seed`` is the run's seed;
    each client derives its own with :func:`client_seed`)."""

    round: int
    epochs: int
    batch_size: int
    lr: float
    seed: int
    momentum: float = 0.0
    proximal_mu: float = 0.0
    extra: dict[str, float | int | bool | str] = field(default_factory=dict)

    def to_record(self) -> ConfigRecord:
        data = {k: v for k, v in asdict(self).items() if k != "extra"}
        data.update({f"x.{k}": v for k, v in self.extra.items()})
        return ConfigRecord(data)

    @classmethod
    def from_record(cls, record: ConfigRecord) -> TrainConfig:
        data: dict[str, Any] = dict(record)
        extra = {k[2:]: data.pop(k) for k in list(data) if k.startswith("x.")}
        return cls(**data, extra=extra)


@dataclass(frozen=True)
class TrainReply:
    delta: np.ndarray
    num_examples: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class EvalReply:
    """A client's score of the global model: on its test split, and its loss
    on its training split (the "training loss" of Li et al. 2020, Fig. 1)."""

    loss: float
    accuracy: float
    num_examples: int
    train_loss: float | None = None
    train_examples: int = 0


def encode_flat(vector: np.ndarray) -> Array:
    """One flat float32 buffer as a Flower ``Array`` (``.npy`` bytes, as ``np.save`` writes them)."""
    from io import BytesIO

    flat = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
    header = BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(flat))
    # one copy into bytes of the exact size (np.save into a BytesIO grows a buffer, then copies it)
    data = b"".join((header.getvalue(), flat.data.cast("B")))
    return Array(dtype="float32", shape=(int(flat.shape[0]),), stype="numpy.ndarray", data=data)


def decode_flat(array: Array, size: int | None = None, max_bytes: int | None = None) -> np.ndarray:
    """Decode a flat float32 ``Array`` without copying, validating it fully.

    Raises
    ------
    UpdateRejected
        Wrong serialisation, dtype, shape or size, oversized, NaN or Inf.
    """
    data = array.data
    if max_bytes is not None and len(data) > max_bytes:
        raise UpdateRejected(f"update is {len(data)} bytes, over the {max_bytes}-byte limit")
    if array.stype != "numpy.ndarray" or array.dtype != "float32":
        raise UpdateRejected(f"update is {array.stype}/{array.dtype}, expected numpy.ndarray/float32")
    if len(array.shape) != 1 or (size is not None and array.shape[0] != size):
        raise UpdateRejected(f"update shape is {tuple(array.shape)}, expected ({size},)")
    vector = _npy_view(bytes(data) if not isinstance(data, bytes) else data)
    if vector.shape[0] != array.shape[0]:
        raise UpdateRejected("update bytes do not match the declared shape")
    if not all_finite(vector):
        raise UpdateRejected("update holds NaN or Inf values")
    return vector


def _npy_view(data: bytes) -> np.ndarray:
    from io import BytesIO

    stream = BytesIO(data)
    try:
        version = np.lib.format.read_magic(stream)
        reader = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                  else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = reader(stream)
    except ValueError as exc:
        raise UpdateRejected(f"update is not a valid .npy buffer: {exc}") from None
    if dtype != np.float32 or len(shape) != 1 or fortran:
        raise UpdateRejected(f"update payload is {dtype} {shape}, expected 1-D float32")
    offset = stream.tell()
    if len(data) - offset != shape[0] * 4:
        raise UpdateRejected("update payload is truncated")
    return np.frombuffer(data, dtype=np.float32, count=shape[0], offset=offset)


def train_instruction(params: np.ndarray, config: TrainConfig) -> RecordDict:
    return RecordDict({"global": ArrayRecord({"params": encode_flat(params)}), "config": config.to_record()})


def parse_instruction(content: RecordDict) -> tuple[np.ndarray, TrainConfig]:
    """The global model and training config of a train or evaluate instruction."""
    params = content.array_records["global"]["params"].numpy()
    return params.astype(np.float32, copy=False), TrainConfig.from_record(content.config_records["config"])


def train_reply(delta: np.ndarray, num_examples: int, metrics: dict[str, float]) -> RecordDict:
    return RecordDict({
        "update": ArrayRecord({"delta": encode_flat(delta)}),
        "metrics": MetricRecord({"num-examples": int(num_examples), **metrics}),
    })


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
    """The client metrics fit to store and show: numbers within bounds, short keys, a few of them.

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


def parse_train_reply(content: RecordDict, size: int, max_bytes: int) -> TrainReply:
    """Decode and validate a train reply (see :func:`decode_flat`).

    Raises
    ------
    UpdateRejected
        A record of the wrong type, an example count outside ``[1, MAX_EXAMPLES]``,
        or an update :func:`decode_flat` refuses. Metrics out of range are dropped.
    """
    metrics = _metrics(content)
    n = _num_examples(metrics)
    return TrainReply(decode_flat(_update_array(content), size, max_bytes), n, clean_metrics(metrics))


def eval_reply(loss: float, accuracy: float, num_examples: int, train_loss: float | None = None,
               train_examples: int = 0) -> RecordDict:
    metrics: dict[str, MetricRecordValues] = {"num-examples": int(num_examples), "eval-loss": float(loss),
                                              "eval-accuracy": float(accuracy)}
    if train_loss is not None:
        metrics.update({"train-loss": float(train_loss), "train-examples": int(train_examples)})
    return RecordDict({"metrics": MetricRecord(metrics)})


def parse_eval_reply(content: RecordDict) -> EvalReply:
    """Decode and validate an evaluate reply.

    Raises
    ------
    UpdateRejected
        Accuracy outside ``[0, 1]``, a loss that is not a finite number in
        ``[0, MAX_LOSS]``, or a bad example count. A training loss out of range
        is dropped (it is optional).
    """
    metrics = _metrics(content)
    n = _num_examples(metrics)
    loss, acc = metrics.get("eval-loss"), metrics.get("eval-accuracy")
    if not _in_range(loss, 0.0, MAX_LOSS) or not _in_range(acc, 0.0, 1.0):
        raise UpdateRejected(f"eval metrics out of range (loss in [0, {MAX_LOSS:g}], accuracy in [0, 1]): "
                             f"loss={loss!r} accuracy={acc!r}")
    train_loss, train_n = metrics.get("train-loss"), metrics.get("train-examples", 0)
    if not _in_range(train_loss, 0.0, MAX_LOSS) or not _in_range(train_n, 1, MAX_EXAMPLES):
        train_loss, train_n = None, 0
    return EvalReply(float(loss), float(acc), n, None if train_loss is None else float(train_loss), int(train_n))


def content_bytes(content: RecordDict) -> int:
    """Approximate wire size of a message's arrays (their serialised bytes)."""
    total = 0
    for record in content.array_records.values():
        total += sum(len(a.data) for a in record.values())
    return total
