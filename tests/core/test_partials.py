"""An edge's partial sum on the wire: what it sends reads back exactly, and whatever else it sends is refused.

An edge aggregator is untrusted like any client: the property tests throw
replies with every field replaced by junk (huge integers, NaN, infinities,
wrong types, wrong lengths, devices never asked) at the parser, which answers
with a parsed reply whose figures are consistent, or the project's own
rejection, never anything else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import UpdateRejected
from core.partials import (
    MAX_NAME_CHARS,
    devices_query,
    devices_reply,
    edge_devices,
    edge_instruction,
    edge_secured,
    eval_partial_reply,
    parse_devices_reply,
    parse_eval_partial,
    parse_partial_reply,
    partial_reply,
    renamed_devices,
)
from core.records import ClientRecord
from core.status import ClientStatus

SIZE = 4
ASKED = [3, 5, 8]


def _rows() -> list[ClientRecord]:
    return [ClientRecord(client="3", outcome=ClientStatus.OK, num_examples=10, train_loss=0.5, duration_s=1.5,
                         bytes_in=100, bytes_out=200),
            ClientRecord(client="5", outcome=ClientStatus.OK, num_examples=30, train_loss=0.25),
            ClientRecord(client="8", outcome=ClientStatus.DROPPED, stage="train", reason="no reply within 5 s")]


def _valid() -> RecordDict:
    return partial_reply(np.array([1.0, -2.0, 0.5, 3.0], np.float64), 40.0, 2, _rows(), seconds=2.5)


def test_a_partial_sum_reads_back_as_sent() -> None:
    parsed = parse_partial_reply(_valid(), SIZE, 1 << 20, ASKED)
    assert parsed.total is not None and parsed.total.dtype == np.float32
    np.testing.assert_array_equal(parsed.total, [1.0, -2.0, 0.5, 3.0])
    assert (parsed.weight, parsed.count, parsed.seconds) == (40.0, 2, 2.5)
    assert parsed.devices == _rows()


def test_an_edge_that_folded_nothing_sends_no_sum() -> None:
    rows = [ClientRecord(client="3", outcome=ClientStatus.DROPPED, reason="gone")]
    parsed = parse_partial_reply(partial_reply(None, 0.0, 0, rows, 1.0), SIZE, 1 << 20, ASKED)
    assert parsed.total is None and parsed.count == 0 and parsed.devices == rows


def _with(content: RecordDict, record: str, key: str, value: Any) -> RecordDict:
    out = RecordDict(dict(content.items()))
    old = out[record]
    out[record] = type(old)({**dict(old), key: value})
    return out


@pytest.mark.parametrize(("record", "key", "value", "why"), [
    ("partial-totals", "count", 3, "count is 3, but 2"),
    ("partial-totals", "count", 4, "count must be an integer in \\[0, 3\\]"),
    ("partial-totals", "weight", 0.0, "weight must be positive"),
    ("partial-totals", "weight", float("inf"), "weight must be positive"),
    ("partial-totals", "weight", float("nan"), "weight must be positive"),
    ("partial-totals", "seconds", -1.0, "seconds"),
    ("devices", "client", ["3", "5", "99"], "stray: \\['99'\\]"),
    ("devices", "client", ["3", "3", "8"], "at most once"),
    ("devices", "outcome", ["ok", "ok", "exploded"], "unknown outcome 'exploded'"),
    ("devices", "outcome", ["ok", "ok", "ok"], "count is 2, but 3"),
    ("devices", "num-examples", [10, 30, -5], "num-examples must be an integer"),
    ("devices", "num-examples", [10, 30, 10**12], "num-examples must be an integer"),
    ("devices", "train-loss", [0.5, float("nan"), -1.0], "train-loss must be in"),
    ("devices", "reason", ["", ""], "different lengths"),
])
def test_a_forged_field_is_refused_naming_it(record: str, key: str, value: Any, why: str) -> None:
    with pytest.raises(UpdateRejected, match=why):
        parse_partial_reply(_with(_valid(), record, key, value), SIZE, 1 << 20, ASKED)


def test_a_sum_of_the_wrong_size_or_holding_nan_is_refused() -> None:
    for total, why in ((np.ones(SIZE + 1), "shape"), (np.array([1.0, np.nan, 0, 0]), "NaN")):
        bad = _valid()
        bad["partial"] = partial_reply(total, 40.0, 2, _rows(), 1.0)["partial"]
        with pytest.raises(UpdateRejected, match=why):
            parse_partial_reply(bad, SIZE, 1 << 20, ASKED)
    with pytest.raises(UpdateRejected, match="over the 8-byte limit"):
        parse_partial_reply(_valid(), SIZE, 8, ASKED)
    missing = _valid()
    del missing["partial"]
    with pytest.raises(UpdateRejected, match="no 'partial'/'sum' array"):
        parse_partial_reply(missing, SIZE, 1 << 20, ASKED)


def test_the_edge_instruction_names_its_devices() -> None:
    base = RecordDict({"config": ConfigRecord({"round": 1})})
    message = edge_instruction(base, [4, 2, 9])
    assert edge_devices(message) == [4, 2, 9]
    assert message["config"] == base["config"]
    with pytest.raises(UpdateRejected, match="not an edge aggregator"):
        edge_devices(base)
    for devices in ([1, 1], [-1], [True]):
        forged = RecordDict({"edge": ConfigRecord({"devices": devices})})
        with pytest.raises(UpdateRejected):
            edge_devices(forged)


_junk = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=20),
                  st.lists(st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.floats(),
                                     st.text(max_size=5)), max_size=5))
_fields = st.sampled_from([("partial-totals", k) for k in ("weight", "count", "seconds")]
                          + [("devices", k) for k in ("client", "outcome", "stage", "reason", "num-examples",
                                                      "bytes-in", "bytes-out", "train-loss", "duration-s")])


def _set(content: RecordDict, record: str, key: str, value: Any) -> RecordDict | None:
    try:
        return _with(content, record, key, value)
    except Exception:  # Flower's records refuse the type itself: nothing an edge could send
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_fields, _junk), min_size=1, max_size=4))
def test_junk_in_any_field_parses_consistently_or_is_refused(changes: list[tuple[tuple[str, str], Any]]) -> None:
    content: RecordDict | None = _valid()
    for (record, key), value in changes:
        content = _set(content, record, key, value) if content is not None else None
    if content is None:
        return
    try:
        parsed = parse_partial_reply(content, SIZE, 1 << 20, ASKED)
    except UpdateRejected:
        return
    # what parses is consistent: the count is the ok rows, each row a device asked, once, figures in range
    assert parsed.count == sum(1 for d in parsed.devices if d.outcome == ClientStatus.OK)
    assert len({d.client for d in parsed.devices}) == len(parsed.devices)
    assert {d.client for d in parsed.devices} <= {str(n) for n in ASKED}
    assert (parsed.weight > 0) == (parsed.count > 0) and np.isfinite(parsed.weight)
    assert all(0 <= d.num_examples <= 10**9 and d.bytes_in >= 0 for d in parsed.devices)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["partial-totals", "devices", "partial"]),
       st.sampled_from([MetricRecord({}), ConfigRecord({}), ArrayRecord({}),
                        ArrayRecord({"sum": Array(dtype="int64", shape=(4,), stype="numpy.ndarray", data=b"x" * 32)})]))
def test_a_record_of_the_wrong_kind_is_refused(record: str, replacement: Any) -> None:
    content = _valid()
    content[record] = replacement
    with pytest.raises(UpdateRejected):
        parse_partial_reply(content, SIZE, 1 << 20, ASKED)


def test_a_secured_round_takes_no_sum_in_clear() -> None:
    # asked for a secure sum across the edges: the weight and count come in clear, the sum must not
    secured = partial_reply(None, 40.0, 2, _rows(), seconds=1.0)
    parsed = parse_partial_reply(secured, SIZE, 1 << 20, ASKED, secure=True)
    assert parsed.total is None and (parsed.weight, parsed.count) == (40.0, 2)
    with pytest.raises(UpdateRejected, match="sum in clear"):
        parse_partial_reply(_valid(), SIZE, 1 << 20, ASKED, secure=True)
    # and a round that did not ask for it refuses a reply without the sum it owes
    with pytest.raises(UpdateRejected, match="no 'partial'/'sum' array"):
        parse_partial_reply(secured, SIZE, 1 << 20, ASKED)
    message = edge_instruction(RecordDict(), [1], secure=True)
    assert edge_secured(message) and not edge_secured(edge_instruction(RecordDict(), [1]))


_eval_values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["num-examples", "eval-loss", "eval-accuracy", "eval-mae", "train-loss", "train-examples"]),
       _eval_values, st.sampled_from(["eval:1", "eval:2", "eval:7", "eval:x", "other"]))
def test_junk_in_an_edges_evaluation_parses_within_range_or_is_refused(key: str, value: Any, record: str) -> None:
    content = eval_partial_reply({1: (0.5, 0.75, 10)}, {1: {"mae": 0.2}}, {1: (0.4, 30)}, {2: ("dropped", "gone")})
    try:
        figures = dict(content.get(record, MetricRecord({"num-examples": 3, "eval-loss": 0.1})))
        figures[key] = value
        content[record] = MetricRecord(figures)
    except Exception:  # Flower's records refuse the value itself: nothing an edge could send
        return
    try:
        rows = parse_eval_partial(content, [1, 2])
    except UpdateRejected:
        return
    for reply in rows.results.values():  # what parses is a score a device's own reply could carry
        assert reply.loss is None or 0 <= reply.loss <= 1e9
        assert reply.accuracy is None or 0 <= reply.accuracy <= 1
        assert 1 <= reply.num_examples <= 10**9
    assert set(rows.results) | set(rows.lost) <= {1, 2} and not set(rows.results) & set(rows.lost)


# ---------------------------------------------------------------------------------- which devices an edge has


def test_an_edges_devices_read_back_as_sent() -> None:
    said = parse_devices_reply(devices_reply("edge-a", {2**64 - 1: "ward-3", 7: ""}))
    assert (said.edge, said.devices) == ("edge-a", {7: "", 2**64 - 1: "ward-3"})
    assert parse_devices_reply(devices_reply("edge-b", {})).devices == {}
    with pytest.raises(UpdateRejected, match="no 'edge-fleet' record"):
        parse_devices_reply(RecordDict())
    with pytest.raises(UpdateRejected, match="edge name"):
        parse_devices_reply(devices_query())  # the question echoed back is no answer


@pytest.mark.parametrize(("key", "value", "why"), [
    ("edge", "", "edge name"), ("edge", "x" * (MAX_NAME_CHARS + 1), "edge name"), ("edge", "a\nb", "edge name"),
    ("devices", [1, 1], "distinct"), ("devices", [-1], "node ids"), ("devices", [True], "node ids"),
    ("devices", [2**64], "node ids"), ("devices", [1.5], "node ids"), ("names", ["a", "b"], "one string"),
    ("names", ["x" * (MAX_NAME_CHARS + 1)], "one string"),
], ids=["empty-name", "long-name", "newline-name", "repeated", "negative", "bool", "past-uint64", "float",
        "names-too-many", "long-device-name"])
def test_a_forged_devices_reply_is_refused_naming_why(key: str, value: Any, why: str) -> None:
    fields: dict[str, Any] = {"edge": "edge-a", "devices": [4], "names": ["d4"], key: value}
    with pytest.raises(UpdateRejected, match=why):
        parse_devices_reply(RecordDict({"edge-fleet": ConfigRecord(fields)}))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["edge", "devices", "names"]), _junk)
def test_junk_in_a_devices_reply_parses_consistently_or_is_refused(key: str, value: Any) -> None:
    fields: dict[str, Any] = {"edge": "edge-a", "devices": [4, 9], "names": ["d4", "d9"], key: value}
    try:
        content = RecordDict({"edge-fleet": ConfigRecord(fields)})
    except Exception:  # Flower's records refuse the type itself: nothing an edge could send
        return
    try:
        said = parse_devices_reply(content)
    except UpdateRejected:
        return
    assert 0 < len(said.edge) <= MAX_NAME_CHARS
    assert all(isinstance(d, int) and 0 <= d < 2**64 for d in said.devices)
    assert all(isinstance(n, str) and n.isprintable() for n in said.devices.values())


# ---------------------------------------------------------------------------------- the aggregator's names


def test_devices_are_renamed_down_and_back_up_and_an_unknown_one_is_left_for_the_parser() -> None:
    down, up = {3: 2**64 - 1, 5: 7}, {2**64 - 1: 3, 7: 5}
    sent = renamed_devices(edge_instruction(RecordDict(), [3, 5]), down)
    assert edge_devices(sent) == [2**64 - 1, 7]
    rows = [ClientRecord(client=str(2**64 - 1), outcome=ClientStatus.OK, num_examples=4),
            ClientRecord(client="7", outcome=ClientStatus.DROPPED)]
    back = renamed_devices(partial_reply(np.ones(SIZE, np.float32), 4.0, 1, rows, 1.0), up)
    assert [d.client for d in parse_partial_reply(back, SIZE, 1 << 20, [3, 5]).devices] == ["3", "5"]
    evals = renamed_devices(eval_partial_reply({2**64 - 1: (0.5, 0.9, 10)}, {}, {}, {7: ("dropped", "gone")}), up)
    parsed = parse_eval_partial(evals, [3, 5])
    assert set(parsed.results) == {3} and set(parsed.lost) == {5}
    stray = renamed_devices(partial_reply(None, 0.0, 0, [ClientRecord(client="99", outcome="dropped")], 1.0), up)
    with pytest.raises(UpdateRejected):  # 99 is no device it was asked about, renamed or not
        parse_partial_reply(stray, SIZE, 1 << 20, [3, 5])


def test_renaming_in_a_chain_keeps_every_record() -> None:
    # 5 -> 100 and 100 -> 200 at once: renamed one after the other in place, 5's record would land on 200
    content = eval_partial_reply({5: (0.5, 0.9, 10), 100: (0.1, 0.2, 3)}, {}, {}, {})
    out = renamed_devices(content, {5: 100, 100: 200})
    assert out["eval:100"]["num-examples"] == 10 and out["eval:200"]["num-examples"] == 3


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["edge", "devices", "edge-eval-lost"]), st.sampled_from(["devices", "client"]), _junk)
def test_renaming_junk_never_raises(record: str, key: str, value: Any) -> None:
    try:
        content = RecordDict({record: ConfigRecord({key: value}), "eval:12": MetricRecord({"num-examples": 1})})
    except Exception:  # Flower's records refuse the type itself: nothing an edge could send
        return
    out = renamed_devices(content, {12: 13, 4: 5})
    assert "eval:13" in out and "eval:12" not in out
