"""Evaluation of the global model, federated and server-side.

Federated: the clients score the global model on their own test split.
Server-side: the aggregator scores it on a held-out set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid

from aggregator.collect import collect, push
from core.errors import UpdateRejected
from core.eval_replies import parse_eval_reply
from core.instructions import TrainConfig, evaluate_instruction
from core.layouts import ParamLayout
from core.outcomes import DROPPED, FAILED, REFUSED, error_outcome
from core.weighting import WeightPolicy
from core.wire import wire_bytes
from learning.task import Metrics, TaskModel

__all__ = ["EvalSummary", "federated_evaluate", "summarise", "EvaluateWorkflow", "ServerEvaluator",
           "task_round_metrics"]


@dataclass(frozen=True)
class EvalSummary:
    """Example-weighted means over the clients that answered."""

    loss: float | None
    accuracy: float | None
    train_loss: float | None
    per_client: dict[int, tuple[float | None, float | None, int]]
    metrics: dict[str, float] = field(default_factory=dict)  # the task's named figures (mae, r2, ...)
    per_client_metrics: dict[int, dict[str, int | float]] = field(default_factory=dict)  # node -> its named figures
    rejected: dict[int, str] = field(default_factory=dict)  # node -> why its reply was refused (a NaN loss, ...)
    failed: dict[int, str] = field(default_factory=dict)  # node -> the error its evaluate task raised
    refused: dict[int, str] = field(default_factory=dict)  # node -> the rule its site policy refused by
    dropped: tuple[int, ...] = ()  # the nodes asked that never answered within the deadline
    bytes_in: int = 0  # the replies, as serialised on Flower's wire
    bytes_out: int = 0  # the instructions sent
    per_client_train: dict[int, tuple[float, int]] = field(default_factory=dict)  # node -> its training loss, n


def federated_evaluate(grid: Grid, nodes: Sequence[int], params: np.ndarray, config: TrainConfig,
                       deadline_s: float, layout: ParamLayout | None = None) -> EvalSummary:
    """Ask ``nodes`` to evaluate ``params``; the weighted mean of what comes back.

    Replies are range-checked (:func:`core.eval_replies.parse_eval_reply`) and each
    client's example count is capped at 3x the median (:class:`WeightPolicy`),
    so no client that claims a huge test set decides the federated score. A
    refused reply (a NaN loss, an accuracy of 2) counts for nothing, and its
    reason is kept in :attr:`EvalSummary.rejected`; the error of a task that
    raised, in :attr:`EvalSummary.failed` (a node that is gone is not asked again); the rule
    of a device whose site policy refused, in :attr:`EvalSummary.refused`;
    a node that never answered within ``deadline_s``, in :attr:`EvalSummary.dropped`.
    """
    instruction = evaluate_instruction(params, config, layout)  # one message content for every node
    content = {n: instruction for n in nodes}
    traffic = {"in": 0}
    results: dict[int, tuple[float | None, float | None, int]] = {}
    named: dict[int, dict[str, int | float]] = {}
    train: dict[int, tuple[float, int]] = {}
    rejected: dict[int, str] = {}
    failed: dict[int, str] = {}
    refused: dict[int, str] = {}
    gone: set[int] = set()  # answered by the SuperLink with an error that the node is unavailable

    def on_reply(node: int, reply: Message) -> None:
        if reply.has_error():
            outcome, reason = error_outcome(reply.error)
            if outcome == FAILED:
                failed[node] = reason
            elif outcome == REFUSED:
                refused[node] = reason
            elif outcome == DROPPED:  # the SuperLink says the node is gone: as good as no reply
                gone.add(node)
            return
        traffic["in"] += wire_bytes(reply.content)
        try:
            parsed = parse_eval_reply(reply.content)
        except UpdateRejected as exc:
            rejected[node] = str(exc)
            return
        results[node] = (parsed.loss, parsed.accuracy, parsed.num_examples)
        named[node] = parsed.metrics
        if parsed.train_loss is not None and parsed.train_examples > 0:
            train[node] = (parsed.train_loss, parsed.train_examples)

    missing = collect(grid, push(grid, content, "evaluate", config.round), deadline_s, on_reply)
    summary = summarise(results, named, train, traffic["in"], wire_bytes(instruction) * len(nodes))
    return replace(summary, rejected=rejected, failed=failed, refused=refused, per_client_metrics=named,
                   dropped=tuple(sorted(missing | gone)))


def summarise(results: dict[int, tuple[float | None, float | None, int]], named: dict[int, dict[str, int | float]],
              train: dict[int, tuple[float, int]], bytes_in: int, bytes_out: int) -> EvalSummary:
    """Return the weighted means over the nodes that answered (each one's count capped at 3x the median).

    The nodes are taken in the order given (``results``, ``train``): a tree's
    evaluation (``aggregator.hierarchy``) gives them in the order a flat one
    pulls them, and gets its sums to the bit.
    """
    if not results:
        return EvalSummary(None, None, None, {}, bytes_in=bytes_in, bytes_out=bytes_out, per_client_train=train)
    nodes_in = list(results)
    weights = dict(zip(nodes_in, _ROBUST.weights([results[n][2] for n in nodes_in]), strict=True))
    losses = list(train.values())
    train_loss = (float(np.average([loss for loss, _ in losses], weights=_ROBUST.weights([n for _, n in losses])))
                  if losses else None)
    # a Flower app's reply may name no loss (core.eval_replies): the mean is over those that did
    loss = _weighted({n: lo for n, (lo, _, _) in results.items() if lo is not None}, weights)
    accuracy = _weighted({n: acc for n, (_, acc, _) in results.items() if acc is not None}, weights)
    names = sorted({k for figures in named.values() for k in figures})
    metrics = {k: _weighted({n: named[n][k] for n in nodes_in if k in named[n]}, weights) for k in names}
    return EvalSummary(loss, accuracy, train_loss, results, {k: v for k, v in metrics.items() if v is not None},
                       bytes_in=bytes_in, bytes_out=bytes_out, per_client_train=train)


def _weighted(values: dict[int, float], weights: dict[int, float]) -> float | None:
    """Return the weighted mean of the nodes' ``values`` (``None`` when no node reported one)."""
    if not values:
        return None
    return float(np.average(list(values.values()), weights=[weights[n] for n in values]))


_ROBUST = WeightPolicy("median", median_cap=3.0)

#: A round's federated evaluation: (grid, nodes, global model, config, deadline, layout) to the nodes' scores.
EvaluateWorkflow = Callable[[Grid, Sequence[int], np.ndarray, TrainConfig, float, ParamLayout | None], EvalSummary]


class ServerEvaluator:
    """Scores flat (trainable) parameters on the aggregator's held-out set with the task's own evaluate."""

    def __init__(self, model_factory: Callable[[], TaskModel], test_set: Any) -> None:
        self._model = model_factory()
        self._test = test_set

    def score(self, params: np.ndarray) -> Metrics:
        """Every metric the task reports: ``loss``, ``num_examples`` and its own (``accuracy``, ``mae``, ...)."""
        self._model.set_flat(params)
        return self._model.evaluate(self._test)

    def __call__(self, params: np.ndarray) -> tuple[float, float | None]:
        """Return the loss and the accuracy (``None`` for a task that reports none)."""
        scores = self.score(params)
        return scores["loss"], scores.get("accuracy")


def task_round_metrics(scores: Metrics, prefix: str = "server-") -> dict[str, float]:
    """Return a task's metrics other than loss, accuracy and the count, named as a round's (``server-mae``)."""
    return {prefix + k: v for k, v in scores.items() if k not in ("loss", "accuracy", "num_examples")}
