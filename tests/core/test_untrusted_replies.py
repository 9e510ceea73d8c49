"""Replies from untrusted clients: every value range-checked, every malformed reply refused with a reason.

The examples are the issue's reproductions (issue 12, "Why"); the property
tests throw random record layouts and values at the decoder: the answer is a
parsed reply within bounds or :class:`UpdateRejected`, never another exception.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.errors import UpdateRejected
from core.eval_replies import eval_reply, parse_eval_reply
from core.replies import MAX_EXAMPLES, clean_metrics, parse_train_reply, train_reply

SIZE = 4


def test_update_sent_as_config_or_metric_record_is_rejected_with_a_reason() -> None:
    # Prepare: the "update" sent as a ConfigRecord or a MetricRecord (once an AttributeError)
    metrics = MetricRecord({"num-examples": 3})
    as_config = RecordDict({"update": ConfigRecord({"delta": b"\x00" * 16}), "metrics": metrics})
    as_metric = RecordDict({"update": MetricRecord({"delta": 1.0}), "metrics": metrics})
    # Execute / Assert
    with pytest.raises(UpdateRejected, match="'update' is a ConfigRecord, expected an ArrayRecord"):
        parse_train_reply(as_config, SIZE, 10**6)
    with pytest.raises(UpdateRejected, match="'update' is a MetricRecord, expected an ArrayRecord"):
        parse_train_reply(as_metric, SIZE, 10**6)


def test_metrics_sent_as_config_record_is_rejected() -> None:
    content = RecordDict({"update": ArrayRecord({"delta": Array(np.ones(SIZE, np.float32))}),
                          "metrics": ConfigRecord({"num-examples": 3})})
    with pytest.raises(UpdateRejected, match="'metrics' is a ConfigRecord, expected a MetricRecord"):
        parse_train_reply(content, SIZE, 10**6)


@pytest.mark.parametrize("count", [2**63, 2**62, 10**39, 10**12, MAX_EXAMPLES + 1, 0])
def test_example_counts_beyond_the_bound_are_rejected(count: int) -> None:
    # 2**63 once broke the store, 10**39 overflowed the weight, 2**62 broke /api/clients
    with pytest.raises(UpdateRejected, match=r"num-examples must be an integer in \[1, 1000000000\]"):
        parse_train_reply(train_reply(np.ones(SIZE, np.float32), count, {}), SIZE, 10**6)


def test_the_largest_allowed_count_is_accepted() -> None:
    parsed = parse_train_reply(train_reply(np.ones(SIZE, np.float32), MAX_EXAMPLES, {}), SIZE, 10**6)
    assert parsed.num_examples == 10**9


def test_metrics_out_of_range_are_dropped_before_they_reach_the_store() -> None:
    # Prepare
    metrics = {"train-loss": math.inf, "duration-s": -1.0, "accuracy": 0.9, "huge": 1e300, "n": 2**62,
               "nan": math.nan, "list": [1.0, 2.0], "k" * 65: 1.0, "ok-int": 7}
    # Execute
    kept = clean_metrics(metrics)
    # Assert
    assert kept == {"accuracy": 0.9, "ok-int": 7}


@pytest.mark.parametrize(("loss", "accuracy"), [(0.5, 1e6), (0.5, -0.1), (-1.0, 0.5), (math.inf, 0.5),
                                                (0.5, math.nan), (2e9, 0.5)])
def test_eval_reply_out_of_range_is_rejected(loss: float, accuracy: float) -> None:
    # eval-accuracy = 1e6 was once stored as a federated accuracy of 999999.99
    with pytest.raises(UpdateRejected, match="eval metrics out of range"):
        parse_eval_reply(eval_reply(loss, accuracy, 10))


def test_eval_reply_with_unusable_training_loss_keeps_the_score() -> None:
    parsed = parse_eval_reply(eval_reply(0.25, 1.0, 10, train_loss=math.inf, train_examples=5))
    assert (parsed.loss, parsed.accuracy, parsed.train_loss, parsed.train_examples) == (0.25, 1.0, None, 0)


# -- property-based -------------------------------------------------------------------------
_numbers = st.one_of(st.integers(min_value=-(2**70), max_value=2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.booleans())
_metric_values = st.one_of(_numbers.filter(lambda v: not isinstance(v, bool)),
                           st.lists(st.floats(allow_nan=False), max_size=3),
                           st.lists(st.integers(-(2**40), 2**40), max_size=3))
_keys = st.sampled_from(["num-examples", "train-loss", "duration-s", "eval-loss", "eval-accuracy",
                         "train-examples", "x"])


def _array() -> st.SearchStrategy[Array]:
    honest = st.builds(lambda n, v: Array(np.full(n, v, np.float32)), st.integers(0, 6),
                       st.floats(width=32, allow_nan=True, allow_infinity=True))
    wrong_dtype = st.builds(lambda n: Array(np.ones(n, np.float64)), st.integers(0, 6))
    junk = st.builds(lambda data, shape, dtype, stype: Array(dtype=dtype, shape=shape, stype=stype, data=data),
                     st.binary(max_size=200), st.lists(st.integers(0, 8), max_size=3).map(tuple),
                     st.sampled_from(["float32", "float64", "int8", "x"]),
                     st.sampled_from(["numpy.ndarray", "torch", ""]))
    npy_header = st.builds(lambda n, tail: Array(dtype="float32", shape=(n,), stype="numpy.ndarray",
                                                 data=np.lib.format.magic(1, 0) + tail),
                           st.integers(0, 6), st.binary(max_size=120))
    return st.one_of(honest, wrong_dtype, junk, npy_header)


def _record() -> st.SearchStrategy[object]:
    metric = st.dictionaries(_keys, _metric_values, max_size=5).map(MetricRecord)
    config = st.dictionaries(_keys, st.one_of(_numbers, st.text(max_size=5), st.binary(max_size=8)),
                             max_size=3).map(ConfigRecord)
    arrays = st.dictionaries(st.sampled_from(["delta", "params", "x"]), _array(), max_size=2).map(ArrayRecord)
    return st.one_of(metric, config, arrays)


# "arrays" and "fitres.parameters": the Flower and legacy layouts the decoder also reads
_replies = st.dictionaries(st.sampled_from(["update", "metrics", "other", "arrays", "fitres.parameters"]),
                           _record(), max_size=3).map(RecordDict)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_replies)
def test_any_train_reply_is_parsed_within_bounds_or_rejected(content: RecordDict) -> None:
    try:
        parsed = parse_train_reply(content, SIZE, 10**6, reference=np.zeros(SIZE, np.float32))
    except UpdateRejected as exc:
        assert str(exc)
        return
    assert parsed.delta.shape == (SIZE,) and np.isfinite(parsed.delta).all()
    assert 1 <= parsed.num_examples <= MAX_EXAMPLES
    assert all(isinstance(v, (int, float)) and math.isfinite(v) and abs(v) <= 1e15
               for v in parsed.metrics.values())


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(_keys, _metric_values, max_size=6))
def test_any_eval_reply_is_parsed_within_bounds_or_rejected(metrics: dict) -> None:
    try:
        parsed = parse_eval_reply(RecordDict({"metrics": MetricRecord(metrics)}))
    except UpdateRejected as exc:
        assert str(exc)
        return
    assert parsed.accuracy is None or 0.0 <= parsed.accuracy <= 1.0
    assert parsed.loss is None or 0.0 <= parsed.loss <= 1e9  # a Flower app's reply may name no loss
    assert 1 <= parsed.num_examples <= MAX_EXAMPLES
    assert parsed.train_loss is None or 0.0 <= parsed.train_loss <= 1e9
