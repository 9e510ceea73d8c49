"""An edge aggregator's messages: the round's instruction for its devices, and its partial sum back.

The third part of the wire format (beside :mod:`core.instructions` and
:mod:`core.replies`), for a tree of aggregators (``[hierarchy]``,
``docs/hierarchy.md``). The aggregator sends an edge the round's train
instruction plus the devices of its own that were sampled
(:func:`edge_instruction`); the edge trains them and answers with one partial
sum (:func:`partial_reply`): ``sum_i w_i x_i`` over the devices it folded, as
one flat float32 ``Array`` like any update, ``sum_i w_i`` and their count, and
one row per device asked (its outcome, example count, loss, time, bytes), so
the aggregator records every device as a flat round would. A sum, never a
mean: the aggregator's FedAvg over the edges' sums is flat FedAvg over their
devices.

An edge is untrusted like any client: :func:`parse_partial_reply` checks
every field and raises :class:`~core.errors.UpdateRejected` naming the
problem (a row for a device the edge was not asked about, a count that does
not match its rows, a weight that is not a positive finite number, NaN, the
wrong size).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from core.boundary import MAX_REASON_CHARS, rejects_any
from core.errors import UpdateRejected
from core.eval_replies import EvalReply, parse_eval_reply
from core.records import ClientRecord
from core.replies import MAX_EXAMPLES, MAX_LOSS, decode_flat, encode_flat
from core.status import ClientStatus

__all__ = ["EDGE_TRAIN", "EDGE_EVALUATE", "EDGE_QUERY", "devices_query", "devices_reply", "parse_devices_reply",
           "EdgeDevices", "MAX_NAME_CHARS", "eval_partial_reply", "parse_eval_partial", "EvalRows",
           "edge_instruction", "edge_devices", "edge_secured", "renamed_devices",
           "partial_reply", "parse_partial_reply", "PartialReply",
           "MAX_EDGE_DEVICES"]

#: The most devices one edge may be asked to train in a round (one per row of its reply).
MAX_EDGE_DEVICES = 1_000_000

#: The message types an edge aggregator answers in a deployment (a device's ClientApp answers plain
#: ``train`` / ``evaluate``): the round's instruction for its devices, the evaluation's, and "which devices".
EDGE_TRAIN = "train.edge"
EDGE_EVALUATE = "evaluate.edge"
EDGE_QUERY = "query.edge"
#: The longest edge or device name a devices reply may carry.
MAX_NAME_CHARS = 200

_EDGE = "edge"
_FLEET = "edge-fleet"
_PARTIAL = "partial"
_SUM = "sum"
_TOTALS = "partial-totals"
_ROWS = "devices"
#: The per-device columns of a partial reply, each a list as long as ``client``; -1 marks a missing number.
_INT_COLUMNS = ("num-examples", "bytes-in", "bytes-out")
_FLOAT_COLUMNS = ("train-loss", "duration-s")
_STR_COLUMNS = ("client", "outcome", "stage", "reason")
_OUTCOMES = frozenset(s.value for s in ClientStatus)
_MAX_SECONDS = 1e7
_MAX_BYTES = 2**62


def edge_instruction(content: RecordDict, devices: Sequence[int], secure: bool = False) -> RecordDict:
    """Return the round's train instruction ``content`` for an edge: the same records, and the devices to train.

    ``secure``: the edge must send its sum only through secure aggregation across the edges, never in its reply.
    """
    out = RecordDict(dict(content.items()))
    out[_EDGE] = ConfigRecord({"devices": [int(d) for d in devices], "secure": bool(secure)})
    return out


def edge_secured(content: RecordDict) -> bool:
    """Whether an edge instruction asks for the sum through secure aggregation across the edges only."""
    record = content.get(_EDGE) if isinstance(content, RecordDict) else None
    return isinstance(record, ConfigRecord) and record.get("secure") is True


@rejects_any("edge instruction")
def edge_devices(content: RecordDict) -> list[int]:
    """Return the devices an edge instruction asks the edge to train (on the edge: the aggregator's word).

    Raises
    ------
    UpdateRejected
        No ``edge`` record, or its devices are not distinct non-negative integers.
    """
    record = content.get(_EDGE) if isinstance(content, RecordDict) else None
    if not isinstance(record, ConfigRecord):
        raise UpdateRejected("instruction has no 'edge' record: it was sent to a device, not an edge aggregator")
    devices: Any = record.get("devices")
    if not isinstance(devices, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in devices):
        raise UpdateRejected("'edge' devices must be a list of non-negative integers")
    if len(set(devices)) != len(devices) or len(devices) > MAX_EDGE_DEVICES:
        raise UpdateRejected(f"'edge' devices must be distinct, at most {MAX_EDGE_DEVICES:,}")
    return list(devices)


def partial_reply(total: np.ndarray | None, weight: float, count: int, devices: Sequence[ClientRecord],
                  seconds: float) -> RecordDict:
    """Build an edge's reply: the weighted sum of its folded updates (``None``: none, or sent securely), weight, count.

    ``devices`` are its rows, one per device asked; ``seconds`` how long its
    sub-round took. An edge asked for a secure sum across the edges sends
    ``total=None`` with its weight and count: the sum goes through the protocol.
    """
    records: dict[str, Any] = {
        _TOTALS: MetricRecord({"weight": float(weight), "count": int(count), "seconds": float(seconds)}),
        _ROWS: ConfigRecord({
            "client": [d.client for d in devices], "outcome": [str(d.outcome) for d in devices],
            "stage": [d.stage or "" for d in devices], "reason": [(d.reason or "")[:MAX_REASON_CHARS] for d in devices],
            "num-examples": [int(d.num_examples) for d in devices],
            "bytes-in": [int(d.bytes_in) for d in devices], "bytes-out": [int(d.bytes_out) for d in devices],
            "train-loss": [_or_missing(d.train_loss) for d in devices],
            "duration-s": [_or_missing(d.duration_s) for d in devices]}),
    }
    if total is not None:
        records[_PARTIAL] = ArrayRecord({_SUM: encode_flat(total)})
    return RecordDict(records)


def _or_missing(value: float | None) -> float:
    return float(value) if value is not None and np.isfinite(value) else -1.0


@dataclass(frozen=True)
class PartialReply:
    """A decoded partial sum: ``total`` (``None`` when the edge folded nothing), ``weight``, ``count``, its rows."""

    total: np.ndarray | None
    weight: float
    count: int
    devices: list[ClientRecord]
    seconds: float


@rejects_any("edge reply")
def parse_partial_reply(content: RecordDict, size: int, max_bytes: int, asked: Sequence[int],
                        secure: bool = False) -> PartialReply:
    """Decode and validate an edge's reply to a round that asked it for devices ``asked``.

    ``secure``: the round asked for the sum through secure aggregation across
    the edges; a reply must then carry none (its ``total`` is ``None``).

    Raises
    ------
    UpdateRejected
        A missing or mistyped record; rows of unequal length, for a device not
        asked or twice for one; an unknown outcome or a number out of range; a
        count that is not the number of ``ok`` rows; a weight that is not
        positive and finite while the count is not 0 (or not 0 while it is); a
        sum of the wrong size, oversized, or holding NaN or Inf.
    """
    if not isinstance(content, RecordDict):
        raise UpdateRejected(f"edge reply is a {type(content).__name__}, expected a RecordDict")
    totals = content.get(_TOTALS)
    if not isinstance(totals, MetricRecord):
        raise UpdateRejected(f"edge reply has no {_TOTALS!r} MetricRecord")
    weight: Any = totals.get("weight")
    count: Any = totals.get("count")
    seconds: Any = totals.get("seconds", 0.0)
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= len(asked):
        raise UpdateRejected(f"edge count must be an integer in [0, {len(asked)}] (the devices asked), got {count!r}")
    if not _number(weight, 0.0, float(MAX_EXAMPLES) * max(count, 1)) or (weight > 0) != (count > 0):
        raise UpdateRejected(f"edge weight must be positive and finite with {count} updates (0 with none), "
                             f"got {weight!r}")
    if not _number(seconds, 0.0, _MAX_SECONDS):
        raise UpdateRejected(f"edge seconds must be in [0, {_MAX_SECONDS:g}], got {seconds!r}")
    devices = _rows(content.get(_ROWS), asked)
    ok = sum(1 for d in devices if d.outcome == ClientStatus.OK)
    if ok != count:
        raise UpdateRejected(f"edge count is {count}, but {ok} of its device rows are ok")
    record = content.get(_PARTIAL)
    if count == 0 or secure:
        if record is not None:
            raise UpdateRejected("edge reply carries a sum in clear, which the round asked for through secure "
                                 "aggregation across the edges" if secure else
                                 "edge reply carries a sum with no update folded")
        return PartialReply(None, float(weight), count, devices, float(seconds))
    array = record.get(_SUM) if isinstance(record, ArrayRecord) else None
    if array is None:
        raise UpdateRejected(f"edge reply has no {_PARTIAL!r}/{_SUM!r} array with {count} updates folded")
    return PartialReply(decode_flat(array, size, max_bytes), float(weight), count, devices, float(seconds))


def _number(value: Any, low: float, high: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


def _rows(record: Any, asked: Sequence[int]) -> list[ClientRecord]:
    if not isinstance(record, ConfigRecord):
        raise UpdateRejected(f"edge reply has no {_ROWS!r} ConfigRecord")
    columns: dict[str, Any] = {key: record.get(key) for key in (*_STR_COLUMNS, *_INT_COLUMNS, *_FLOAT_COLUMNS)}
    bad = [key for key, column in columns.items() if not isinstance(column, list)]
    if bad:
        raise UpdateRejected(f"edge device rows lack the column(s) {bad}")
    lengths = {len(column) for column in columns.values()}
    if len(lengths) != 1:
        raise UpdateRejected(f"edge device rows have columns of different lengths {sorted(lengths)}")
    clients = columns["client"]
    allowed = {str(n) for n in asked}
    if len(set(clients)) != len(clients) or not set(clients) <= allowed:
        stray = sorted(set(map(str, clients)) - allowed)[:3]
        raise UpdateRejected(f"edge device rows must name each device asked at most once (stray: {stray})")
    return [_row(columns, i) for i in range(len(clients))]


def _row(columns: dict[str, Any], i: int) -> ClientRecord:
    def text(key: str) -> str:
        value = columns[key][i]
        if not isinstance(value, str):
            raise UpdateRejected(f"edge device row {i}: {key} is a {type(value).__name__}, expected a string")
        return value[:MAX_REASON_CHARS]

    def integer(key: str, high: int) -> int:
        value = columns[key][i]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise UpdateRejected(f"edge device row {i}: {key} must be an integer in [0, {high}], got {value!r}")
        return value

    def real(key: str, high: float) -> float | None:
        value = columns[key][i]
        if value == -1.0 and not isinstance(value, bool):
            return None
        if not _number(value, 0.0, high):
            raise UpdateRejected(f"edge device row {i}: {key} must be in [0, {high:g}] (or -1), got {value!r}")
        return float(value)

    outcome = text("outcome")
    if outcome not in _OUTCOMES:
        raise UpdateRejected(f"edge device row {i}: unknown outcome {outcome!r}")
    return ClientRecord(client=text("client"), outcome=outcome, num_examples=integer("num-examples", MAX_EXAMPLES),
                        train_loss=real("train-loss", MAX_LOSS), duration_s=real("duration-s", _MAX_SECONDS),
                        bytes_in=integer("bytes-in", _MAX_BYTES), bytes_out=integer("bytes-out", _MAX_BYTES),
                        stage=text("stage") or None, reason=text("reason") or None)


# -- evaluation through an edge ------------------------------------------------------------------------------------

_EVAL_PREFIX = "eval:"
_EVAL_LOST = "edge-eval-lost"
_LOST_OUTCOMES = frozenset({ClientStatus.DROPPED, ClientStatus.REJECTED, ClientStatus.FAILED, ClientStatus.REFUSED})


def eval_partial_reply(results: Mapping[int, tuple[float | None, float | None, int]],
                       named: Mapping[int, Mapping[str, float]], train: Mapping[int, tuple[float, int]],
                       lost: Mapping[int, tuple[str, str]]) -> RecordDict:
    """Build an edge's answer to an evaluation: each device's scores as its own evaluate reply would carry them.

    ``results``: device -> (loss, accuracy, test examples); ``named``: its
    task's other figures; ``train``: its training loss and examples; ``lost``:
    device -> (outcome, reason) for a device whose evaluation is missing
    (dropped, rejected, failed or refused). The aggregator reads each device's
    record as it reads a device's reply (:func:`parse_eval_partial`).
    """
    records: dict[str, Any] = {}
    for node, (loss, accuracy, examples) in results.items():
        figures: dict[str, Any] = {"num-examples": int(examples)}
        if loss is not None:
            figures["eval-loss"] = float(loss)
        if accuracy is not None:
            figures["eval-accuracy"] = float(accuracy)
        figures.update({f"eval-{k}": float(v) for k, v in named.get(node, {}).items()})
        if node in train:
            figures["train-loss"], figures["train-examples"] = float(train[node][0]), int(train[node][1])
        records[f"{_EVAL_PREFIX}{int(node)}"] = MetricRecord(figures)
    ordered = sorted(lost.items())
    records[_EVAL_LOST] = ConfigRecord({"client": [str(n) for n, _ in ordered],
                                        "outcome": [str(o) for _, (o, _) in ordered],
                                        "reason": [r[:MAX_REASON_CHARS] for _, (_, r) in ordered]})
    return RecordDict(records)


@dataclass(frozen=True)
class EvalRows:
    """An edge's evaluation, decoded: each device's scores, and why each missing device is missing."""

    results: dict[int, EvalReply]
    lost: dict[int, tuple[str, str]]  # device -> (outcome, reason)


@rejects_any("edge eval reply")
def parse_eval_partial(content: RecordDict, asked: Sequence[int]) -> EvalRows:
    """Decode and validate an edge's evaluation of the devices ``asked``.

    Each device's record is checked as its own evaluate reply would be
    (:func:`core.eval_replies.parse_eval_reply`: ranges, counts, names).

    Raises
    ------
    UpdateRejected
        A record for a device not asked, or twice for one (scored and lost); a
        lost row whose outcome is not dropped, rejected, failed or refused; a
        device record its own reply would be refused for.
    """
    if not isinstance(content, RecordDict):
        raise UpdateRejected(f"edge eval reply is a {type(content).__name__}, expected a RecordDict")
    allowed = {int(n) for n in asked}
    results: dict[int, EvalReply] = {}
    for key in content:
        if key == _EVAL_LOST:
            continue
        node = _device_key(key, allowed)
        record = content[key]
        if not isinstance(record, MetricRecord):
            raise UpdateRejected(f"edge eval record {key!r} is a {type(record).__name__}, expected a MetricRecord")
        try:
            results[node] = parse_eval_reply(RecordDict({"metrics": record}))
        except UpdateRejected as exc:
            raise UpdateRejected(f"device {node}: {exc}") from None
    lost_record = content.get(_EVAL_LOST)
    if not isinstance(lost_record, ConfigRecord):
        raise UpdateRejected(f"edge eval reply has no {_EVAL_LOST!r} ConfigRecord")
    columns: dict[str, Any] = {k: lost_record.get(k) for k in ("client", "outcome", "reason")}
    if not all(isinstance(c, list) and all(isinstance(v, str) for v in c) for c in columns.values()) or \
            len({len(c) for c in columns.values()}) != 1:
        raise UpdateRejected("edge eval lost rows must be three lists of strings of one length")
    lost: dict[int, tuple[str, str]] = {}
    for client, outcome, reason in zip(columns["client"], columns["outcome"], columns["reason"], strict=True):
        node = _device_key(_EVAL_PREFIX + client, allowed)
        if node in results or node in lost:
            raise UpdateRejected(f"edge eval reply names device {node} twice")
        if outcome not in _LOST_OUTCOMES:
            raise UpdateRejected(f"edge eval lost row for device {node}: outcome {outcome[:20]!r} is not one of "
                                 "dropped, rejected, failed, refused")
        lost[node] = (outcome, " ".join(reason.split())[:MAX_REASON_CHARS])
    return EvalRows(results, lost)


def _device_key(key: str, allowed: set[int]) -> int:
    """Return the device a record of an edge's evaluation is for: one the edge was asked about."""
    text = key[len(_EVAL_PREFIX):] if key.startswith(_EVAL_PREFIX) else ""
    node = int(text) if text.isdigit() and len(text) <= 20 else None  # a Flower node id: up to 2**64 - 1
    if node is None or node not in allowed:
        raise UpdateRejected(f"edge eval reply has a record {key[:40]!r} for no device it was asked about")
    return node


def devices_query() -> RecordDict:
    """Return the question the aggregator asks each edge before it samples: which devices are under it."""
    return RecordDict({_FLEET: ConfigRecord({"ask": "devices"})})


def devices_reply(edge: str, devices: Mapping[int, str]) -> RecordDict:
    """Return an edge's answer: its own name, and its connected devices (node id -> enrolled name, "" unknown)."""
    ids = sorted(int(d) for d in devices)
    return RecordDict({_FLEET: ConfigRecord({"edge": edge[:MAX_NAME_CHARS], "devices": ids,
                                             "names": [str(devices[d])[:MAX_NAME_CHARS] for d in ids]})})


@dataclass(frozen=True)
class EdgeDevices:
    """An edge's answer to :func:`devices_query`: its name and its devices (node id -> name)."""

    edge: str
    devices: dict[int, str]


@rejects_any("edge devices reply")
def parse_devices_reply(content: RecordDict) -> EdgeDevices:
    """Read an edge's :func:`devices_reply`; the aggregator's untrusted view of what is under the edge.

    Raises
    ------
    UpdateRejected
        No such record, a name that is not a short non-empty string, device ids
        that are not distinct integers in ``[0, 2**64)``, more than
        :data:`MAX_EDGE_DEVICES`, or names not one per device.
    """
    record = content.get(_FLEET) if isinstance(content, RecordDict) else None
    if not isinstance(record, ConfigRecord):
        raise UpdateRejected("edge devices reply has no 'edge-fleet' record")
    edge: Any = record.get("edge")
    ids: Any = record.get("devices")  # checked below, value by value
    names: Any = record.get("names")
    ids, names = ([] if ids is None else ids), ([] if names is None else names)  # Flower drops an empty list
    if not isinstance(edge, str) or not 0 < len(edge) <= MAX_NAME_CHARS or not edge.isprintable():
        raise UpdateRejected(f"edge devices reply: edge name {str(edge)[:40]!r} is not 1 to {MAX_NAME_CHARS} "
                             "printable characters")
    if not isinstance(ids, list) or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**64
                                            for d in ids):
        raise UpdateRejected(f"edge {edge!r}: devices must be a list of node ids in [0, 2**64)")
    if len(ids) > MAX_EDGE_DEVICES or len(set(ids)) != len(ids):
        raise UpdateRejected(f"edge {edge!r}: devices must be distinct, at most {MAX_EDGE_DEVICES:,}")
    if not isinstance(names, list) or len(names) != len(ids) or \
            not all(isinstance(n, str) and len(n) <= MAX_NAME_CHARS for n in names):
        raise UpdateRejected(f"edge {edge!r}: names must be one string of at most {MAX_NAME_CHARS} characters "
                             "per device")
    pairs: list[tuple[int, str]] = list(zip(ids, names, strict=True))
    return EdgeDevices(edge, {d: "".join(c for c in n if c.isprintable()) for d, n in pairs})


# -- naming the devices the aggregator's way -----------------------------------------------------------------------


def renamed_devices(content: RecordDict, names: Mapping[int, int]) -> RecordDict:
    """Return an edge message or answer with its devices renamed by ``names`` (old id -> new id).

    The aggregator of a deployed tree names a device by its enrolled name,
    each edge by its node id on the edge's SuperLink: the aggregator renames
    the devices an instruction lists before it goes down, and the devices an
    answer names (a partial sum's rows, an evaluation's records) when it
    comes up. A device ``names`` does not know keeps its id, so an answer
    about a device the edge was not asked about is still refused by the
    parsers. Records this module does not spell pass unchanged.
    """
    out = RecordDict(dict(content.items()))

    def new(text: Any) -> Any:
        if isinstance(text, str) and text.isdigit() and len(text) <= 20:
            return str(names.get(int(text), int(text)))
        return text

    edge = out.get(_EDGE)
    if isinstance(edge, ConfigRecord) and isinstance(edge.get("devices"), list):
        listed: Any = edge.get("devices")
        out[_EDGE] = ConfigRecord({**dict(edge.items()), "devices": [names.get(d, d) if isinstance(d, int) else d
                                                                      for d in listed]})
    for key in (_ROWS, _EVAL_LOST):
        rows = out.get(key)
        if isinstance(rows, ConfigRecord) and isinstance(rows.get("client"), list):
            clients: Any = rows.get("client")
            out[key] = ConfigRecord({**dict(rows.items()), "client": [new(c) for c in clients]})
    evals = {k: out.pop(k) for k in [k for k in out if k.startswith(_EVAL_PREFIX)]}  # renamed in one pass: a new
    for key, record in evals.items():                                                # name may be an old one
        renamed = f"{_EVAL_PREFIX}{new(key[len(_EVAL_PREFIX):])}"
        if renamed not in out:  # two records for one device: the first kept, the parser sees one
            out[renamed] = record
    return out
