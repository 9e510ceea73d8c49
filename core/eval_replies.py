"""Evaluate replies: encoded on the client, decoded and validated on the aggregator.

The other half of :mod:`core.replies` (train replies). Quorum's client names its figures ``eval-<name>``; a
Flower app names them as it likes (``eval_loss``, quickstart-sklearn's
``test_logloss`` and ``accuracy``, a survival task's ``c_index``): the loss and
the accuracy are found by the names in :data:`LOSS_NAMES` and
:data:`ACCURACY_NAMES`, every other finite number is kept under its own name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from flwr.app.typing import MetricRecordValues

from core.boundary import rejects_any
from core.errors import UpdateRejected
from core.instructions import Instruction, Wire
from core.replies import (
    _LEGACY_OK,
    MAX_EXAMPLES,
    MAX_KEY_CHARS,
    MAX_LOSS,
    _in_range,
    _legacy_status,
    _metrics,
    _num_examples,
    _typed,
    clean_metrics,
)

__all__ = ["EvalReply", "eval_reply", "parse_eval_reply", "LOSS_NAMES", "ACCURACY_NAMES"]


@dataclass(frozen=True)
class EvalReply:
    """A client's score of the global model.

    On its test split, and its loss on its training split (the "training loss"
    of Li et al. 2020, Fig. 1).
    """

    loss: float | None  # None: a Flower app's reply named no loss (only its own metrics)
    accuracy: float | None  # None: the task reports no accuracy (a regression, say)
    num_examples: int
    train_loss: float | None = None
    train_examples: int = 0
    metrics: dict[str, int | float] = field(default_factory=dict)  # the task's others (mae, r2, ...)


def eval_reply(loss: float, accuracy: float | None, num_examples: int, train_loss: float | None = None,
               train_examples: int = 0, answer_to: Instruction | None = None,
               metrics: Mapping[str, float] | None = None) -> RecordDict:
    """Build an evaluate reply in Quorum's names, or in Flower's (``answer_to`` a Flower instruction).

    ``accuracy`` is left out when ``None``; ``metrics`` are the task's other
    named figures (``mae``, ``r2``, ...), sent as ``eval-<name>`` in Quorum's
    layout and under their own names in Flower's.
    """
    named = {k: float(v) for k, v in (metrics or {}).items() if k not in _EVAL_RESERVED}
    if accuracy is not None:
        named["accuracy"] = float(accuracy)
    if answer_to is not None and answer_to.wire is Wire.FLOWER:
        flower = {("eval_acc" if k == "accuracy" else k): v for k, v in named.items()}
        return RecordDict({"metrics": MetricRecord({"eval_loss": float(loss), **flower,
                                                    "num-examples": int(num_examples)})})
    if answer_to is not None and answer_to.wire is Wire.LEGACY:
        return RecordDict({"evaluateres.loss": MetricRecord({"loss": float(loss)}),
                           "evaluateres.num_examples": MetricRecord({"num_examples": int(num_examples)}),
                           "evaluateres.metrics": ConfigRecord(dict(named)),
                           "evaluateres.status": _LEGACY_OK})
    reply: dict[str, MetricRecordValues] = {"num-examples": int(num_examples), "eval-loss": float(loss),
                                            **{f"eval-{k}": v for k, v in named.items()}}
    metrics_out = reply
    if train_loss is not None:
        metrics_out.update({"train-loss": float(train_loss), "train-examples": int(train_examples)})
    return RecordDict({"metrics": MetricRecord(metrics_out)})


@rejects_any("eval reply")
def parse_eval_reply(content: RecordDict) -> EvalReply:
    """Decode and validate an evaluate reply, whatever its metrics are called.

    Quorum's layout names its figures ``eval-<name>``; a Flower app's reply
    carries any names: its loss is the first of :data:`LOSS_NAMES` present
    (``loss``, ``eval_loss``, ``test_loss``, ``test_logloss``, ...) or absent,
    its accuracy the first of :data:`ACCURACY_NAMES`, and every other finite
    number is kept under its own name (``c_index``, ``mae``). A list of
    numbers (quickstart-numpy's ``random_metric``) is no score: left out, the
    reply accepted.

    Raises
    ------
    UpdateRejected
        Accuracy outside ``[0, 1]``, a loss that is not a finite number in
        ``[0, MAX_LOSS]``, a named metric that is not a finite number (the
        reason names it), no figure besides the count, or a bad example count. A training
        loss out of range is dropped (it is optional). A reply in none of
        Quorum's, Flower's or the legacy layout, naming them. Anything else a
        parser raises (:func:`core.boundary.rejects_any`).
    """
    metrics, own = _eval_metrics(content)
    n = _num_examples(metrics)
    loss, acc = metrics.get("eval-loss"), metrics.get("eval-accuracy")
    if not (loss is None or _in_range(loss, 0.0, MAX_LOSS)):
        raise UpdateRejected(f"eval metrics out of range: eval loss is {loss!r} (expected a number in "
                             f"[0, {MAX_LOSS:g}], or none)")
    if not (acc is None or _in_range(acc, 0.0, 1.0)):
        raise UpdateRejected(f"eval metrics out of range: eval accuracy is {acc!r} (expected a number in [0, 1], "
                             "or none)")
    named = clean_metrics(_finite_figures(own))
    if loss is None and acc is None and not own:  # a count alone; a list-only reply (quickstart-numpy's) passes
        raise UpdateRejected(f"eval reply carries no score: expected a loss (one of {', '.join(LOSS_NAMES)}), an "
                             f"accuracy or any named number; got {sorted(metrics)}")
    train_loss, train_n = metrics.get("train-loss"), metrics.get("train-examples", 0)
    if not _in_range(train_loss, 0.0, MAX_LOSS) or not _in_range(train_n, 1, MAX_EXAMPLES):
        train_loss, train_n = None, 0
    return EvalReply(None if loss is None else float(loss), None if acc is None else float(acc), n,
                     None if train_loss is None else float(train_loss), int(train_n), named)


def _finite_figures(own: dict[str, Any]) -> dict[str, int | float]:
    """Return a reply's named metrics: numbers, each finite (else the reply is refused, naming it); lists left out."""
    figures: dict[str, int | float] = {}
    for key, value in own.items():
        if isinstance(value, list):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise UpdateRejected(f"eval metric {str(key)[:MAX_KEY_CHARS]!r} is {str(value)[:40]!r}, expected a "
                                 "finite number")
        figures[key] = value
    return figures


#: Where a Flower app's evaluate reply keeps its loss, the first present wins: ``loss``, Flower's templates'
#: ``eval_loss``, then the official examples' names (quickstart-sklearn's ``test_logloss``) and their kin.
LOSS_NAMES = ("loss", "eval_loss", "test_loss", "test_logloss", "val_loss", "eval_logloss", "logloss")
#: Where it keeps its accuracy, the first present wins.
ACCURACY_NAMES = ("eval_acc", "eval_accuracy", "accuracy", "acc", "test_accuracy", "test_acc", "val_accuracy")
#: The figures of an evaluate reply that are not a task's own named metrics.
_FLOWER_EVAL_KEYS = ("num-examples", "num_examples", "train-loss", "train-examples")
_EVAL_RESERVED = ("loss", "accuracy", "num_examples", "num-examples")


def _first(names: tuple[str, ...], metrics: Mapping[str, Any]) -> str | None:
    return next((k for k in names if k in metrics), None)


def _eval_metrics(content: RecordDict) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read an evaluate reply's figures under Quorum's names, whichever layout it came in, and the task's own."""
    if isinstance(content, RecordDict) and "evaluateres.loss" in content:
        _legacy_status(content, "evaluateres")
        record = content.get("evaluateres.metrics")
        named = dict(record) if isinstance(record, ConfigRecord) else {}
        accuracy = _first(ACCURACY_NAMES, named)
        return ({"num-examples": dict(_typed(content, "evaluateres.num_examples", MetricRecord)).get("num_examples"),
                 "eval-loss": dict(_typed(content, "evaluateres.loss", MetricRecord)).get("loss"),
                 "eval-accuracy": None if accuracy is None else named[accuracy]},
                {k: v for k, v in named.items() if k != accuracy})
    if not isinstance(content, RecordDict) or "metrics" not in content:
        raise UpdateRejected("eval reply is in no known layout: expected a 'metrics' MetricRecord with "
                             "'num-examples' and Quorum's 'eval-loss'/'eval-accuracy' or a Flower app's own names "
                             f"('eval_loss', 'accuracy', ...), or a legacy NumPyClient's 'evaluateres.loss'; got "
                             f"{sorted(content) if isinstance(content, RecordDict) else type(content).__name__}")
    metrics = _metrics(content)
    if any(k.startswith("eval-") for k in metrics):  # Quorum's names
        own = {k.removeprefix("eval-"): v for k, v in metrics.items()
               if k.startswith("eval-") and k not in ("eval-loss", "eval-accuracy")}
        return metrics, own
    loss, accuracy = _first(LOSS_NAMES, metrics), _first(ACCURACY_NAMES, metrics)
    own = {k: v for k, v in metrics.items() if k not in (loss, accuracy) and k not in _FLOWER_EVAL_KEYS}
    return ({**metrics, "eval-loss": None if loss is None else metrics[loss],
             "eval-accuracy": None if accuracy is None else metrics[accuracy]}, own)
