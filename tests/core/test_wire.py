"""``core.wire.wire_bytes`` against Flower's own count of the same content, on generated contents."""

from __future__ import annotations

from unittest import mock

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.app.message import array as flower_array
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute
from hypothesis import given, settings
from hypothesis import strategies as st

from core.wire import content_bytes, wire_bytes


def flower_count(content: RecordDict) -> int:
    """Flower's way: every distinct object (by its SHA-256 id) of the tree, deflated."""
    with no_object_id_recompute():
        return sum(len(obj.deflate()) for obj in get_all_nested_objects(content).values())


names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)
# few distinct payloads, so that equal arrays and equal chunks (sent once by Flower) come up often
payloads = st.sampled_from([b"", b"\x00" * 8, b"\x00" * 24, bytes(range(16)), b"ab" * 10, b"\x07" * 33])


class Größe(Array):  # a subclass: its (non-ASCII) name is the type in each header
    pass


@st.composite
def arrays(draw: st.DrawFn) -> Array:
    data = draw(payloads)
    dtype = draw(st.sampled_from(["uint8", "float32", "int64"]))
    kind = draw(st.sampled_from([Array, Größe]))
    return kind(dtype=dtype, shape=(len(data), draw(st.integers(0, 3))), stype="numpy.ndarray", data=data)


scalars = st.one_of(st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=False))
metric_records = st.dictionaries(names, st.one_of(scalars, st.lists(st.integers(0, 9), max_size=3)),
                                 max_size=4).map(MetricRecord)
config_records = st.dictionaries(names, st.one_of(scalars, st.booleans(), st.text(max_size=5),
                                                  st.binary(max_size=5)), max_size=4).map(ConfigRecord)
array_records = st.dictionaries(names, arrays(), max_size=4).map(ArrayRecord)


@st.composite
def contents(draw: st.DrawFn) -> RecordDict:
    records = draw(st.dictionaries(names, st.one_of(array_records, metric_records, config_records), max_size=5))
    content = RecordDict(records)
    for alias, name in draw(st.lists(st.tuples(names, st.sampled_from(sorted(records) or ["-"])), max_size=2)):
        if name in records and alias not in content:
            content[alias] = records[name]  # one record under two names, as the legacy layout sends it
    return content


@settings(max_examples=300, deadline=None)
@given(contents(), st.sampled_from([5_242_880, 8, 3]))
def test_wire_bytes_equals_flowers_own_count(content: RecordDict, chunk: int) -> None:
    # chunk sizes of a few bytes cut the arrays into many chunks, some of them equal
    with mock.patch.object(flower_array, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", chunk):
        expected = flower_count(content)
        assert wire_bytes(content) == expected


def test_a_model_update_is_counted_exactly_and_an_unsendable_integer_falls_back() -> None:
    update = RecordDict({"update": ArrayRecord({"delta": Array(np.arange(7850, dtype=np.float32))}),
                         "metrics": MetricRecord({"num-examples": 30, "train-loss": 0.25})})
    assert wire_bytes(update) == flower_count(update) > 7850 * 4

    # an integer beyond 64 bits: Flower cannot serialise it, so only the arrays are counted
    update["metrics"] = MetricRecord({"num-examples": 2**70})
    assert wire_bytes(update) == content_bytes(update) == len(update["update"]["delta"].data)
