"""A Flower app's evaluate reply is read whatever its metrics are called (issue 33, item 1).

Quickstart-sklearn answers ``test_logloss`` and ``accuracy``; a survival
task ``c_index`` and no loss at all. The loss is the first of
``core.eval_replies.LOSS_NAMES`` present, or absent; every other finite number is
kept under its own name.
"""

from __future__ import annotations

import math

import pytest
from flwr.app import MetricRecord, RecordDict
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from core.errors import UpdateRejected
from core.eval_replies import LOSS_NAMES, parse_eval_reply


def _reply(**metrics: object) -> RecordDict:
    return RecordDict({"metrics": MetricRecord({"num-examples": 30, **metrics})})


def test_quickstart_sklearns_reply_is_read() -> None:
    # Execute: what sklearnexample/client_app.py's evaluate answers
    parsed = parse_eval_reply(_reply(test_logloss=0.25, accuracy=0.9))

    # Assert
    assert (parsed.loss, parsed.accuracy, parsed.num_examples, parsed.metrics) == (0.25, 0.9, 30, {})


@pytest.mark.parametrize(("metrics", "loss", "others"), [
    ({"loss": 0.1, "eval_loss": 0.2, "test_loss": 0.3}, 0.1, {"eval_loss": 0.2, "test_loss": 0.3}),
    ({"eval_loss": 0.2, "test_loss": 0.3}, 0.2, {"test_loss": 0.3}),
    ({"test_loss": 0.3, "test_logloss": 0.4}, 0.3, {"test_logloss": 0.4}),
    ({"test_logloss": 0.4}, 0.4, {}),
], ids=["loss", "eval_loss", "test_loss", "test_logloss"])
def test_the_loss_is_the_first_documented_name_and_the_rest_are_kept(metrics: dict, loss: float,
                                                                     others: dict) -> None:
    parsed = parse_eval_reply(_reply(**metrics))
    assert parsed.loss == loss and parsed.metrics == others
    assert LOSS_NAMES[:4] == ("loss", "eval_loss", "test_loss", "test_logloss")


def test_a_reply_with_no_loss_keeps_its_own_metrics() -> None:
    # Execute: a survival task's score, and a list (quickstart-numpy's random_metric) that is no score
    parsed = parse_eval_reply(_reply(c_index=0.71, brier=3, random_metric=[0.1, 0.2, 0.3]))

    # Assert: no loss, no accuracy, the numbers under their names
    assert (parsed.loss, parsed.accuracy) == (None, None)
    assert parsed.metrics == {"c_index": 0.71, "brier": 3}


def test_quickstart_numpys_list_only_reply_is_accepted_with_no_figures() -> None:
    parsed = parse_eval_reply(_reply(random_metric=[0.1, 0.2, 0.3]))
    assert (parsed.loss, parsed.accuracy, parsed.metrics, parsed.num_examples) == (None, None, {}, 30)


@pytest.mark.parametrize(("metrics", "reason"), [
    ({"test_logloss": math.nan, "accuracy": 0.9}, "eval loss is nan"),
    ({"test_logloss": -1.0}, "eval loss is -1.0"),
    ({"accuracy": 1.5}, "eval accuracy is 1.5"),
    ({"c_index": math.inf}, "eval metric 'c_index' is 'inf', expected a finite number"),
    ({}, "eval reply carries no score"),
], ids=["nan-loss", "negative-loss", "accuracy", "infinite-metric", "no-score"])
def test_non_finite_or_out_of_range_figures_are_refused_with_the_reason(metrics: dict, reason: str) -> None:
    with pytest.raises(UpdateRejected, match=reason):
        parse_eval_reply(_reply(**metrics))


_NAMES = st.one_of(st.sampled_from([*LOSS_NAMES, "accuracy", "num-examples", "c_index", "random_metric"]),
                   st.text(min_size=1, max_size=80))
_VALUES = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.lists(st.floats(allow_nan=True), max_size=3))


@settings(max_examples=500, deadline=None)
@given(metrics=st.dictionaries(_NAMES, _VALUES, max_size=6))
def test_any_metric_names_and_values_are_read_or_refused_with_a_reason(metrics: dict) -> None:
    # Metric names and values come from the client: whatever they are, the reply is read with finite
    # figures only, or refused with UpdateRejected; no other exception reaches the round.
    try:
        content = RecordDict({"metrics": MetricRecord(metrics)})
    except Exception:  # Flower's own record refuses it before Quorum sees it
        assume(False)
    try:
        reply = parse_eval_reply(content)
    except UpdateRejected as exc:
        assert str(exc).strip()
        return
    figures = [reply.loss, reply.accuracy, reply.train_loss, *reply.metrics.values()]
    assert all(math.isfinite(v) for v in figures if v is not None)
    assert reply.num_examples >= 1
    assert reply.accuracy is None or 0 <= reply.accuracy <= 1
