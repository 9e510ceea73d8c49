"""Evaluate replies carry a task's own named metrics, and accuracy only when the task has one."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from core.errors import UpdateRejected
from core.eval_replies import eval_reply, parse_eval_reply
from core.instructions import Instruction, TrainConfig, Wire
from core.layouts import ParamLayout

CONFIG = TrainConfig(round=1, epochs=1, batch_size=4, lr=0.1, seed=0)


def _addressed(wire: Wire) -> Instruction:
    return Instruction(params=np.zeros(2, np.float32), config=CONFIG, wire=wire,
                       layout=ParamLayout(names=("w",), shapes=((2,),)))


@pytest.mark.parametrize("wire", [None, Wire.FLOWER, Wire.LEGACY])
def test_regression_reply_without_accuracy_keeps_its_named_metrics(wire: Wire | None) -> None:
    # Prepare: a regression task's scores, no accuracy
    answer_to = None if wire is None else _addressed(wire)

    # Execute
    parsed = parse_eval_reply(eval_reply(2.5, None, 40, answer_to=answer_to,
                                         metrics={"mae": 1.25, "r2": 0.5, "loss": 2.5, "num_examples": 40}))

    # Assert: the loss and count travel as such, accuracy is absent, the others by name
    assert (parsed.loss, parsed.accuracy, parsed.num_examples) == (2.5, None, 40)
    assert parsed.metrics == {"mae": 1.25, "r2": 0.5}


def test_accuracy_still_travels_and_is_still_range_checked() -> None:
    # Execute / Assert: a classifier's accuracy comes back as accuracy, not as a named metric
    parsed = parse_eval_reply(eval_reply(0.3, 0.75, 10))
    assert parsed.accuracy == 0.75 and parsed.metrics == {}
    with pytest.raises(UpdateRejected, match="accuracy"):
        parse_eval_reply(RecordDict({"metrics": MetricRecord({"num-examples": 10, "eval-loss": 0.3,
                                                              "eval-accuracy": 1e6})}))


def test_a_clients_named_metrics_are_bounded() -> None:
    # Prepare: a lying client reports a huge figure next to a sane one
    reply = RecordDict({"metrics": MetricRecord({"num-examples": 10, "eval-loss": 0.3, "eval-r2": 1e300,
                                                 "eval-rmse": 2.0})})

    # Execute
    parsed = parse_eval_reply(reply)

    # Assert: only the bounded figure survives
    assert parsed.metrics == {"rmse": 2.0}


@pytest.mark.parametrize("metrics", [{"num-examples": 10, "eval-loss": 0.3, "eval-mae": float("inf")},
                                     {"num-examples": 10, "accuracy": 0.5, "mae": float("nan")}],
                         ids=["quorum", "flower"])
def test_a_non_finite_named_metric_refuses_the_reply_naming_it(metrics: dict) -> None:
    with pytest.raises(UpdateRejected, match="eval metric 'mae' is .*expected a finite number"):
        parse_eval_reply(RecordDict({"metrics": MetricRecord(metrics)}))
