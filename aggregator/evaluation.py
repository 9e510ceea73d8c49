"""Evaluation: federated (clients score the global model on their own test
split) and server-side (the aggregator scores it on a held-out set)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid

from aggregator.collect import collect, push
from core.errors import UpdateRejected
from core.messages import TrainConfig, parse_eval_reply, train_instruction
from core.weighting import WeightPolicy
from learning.models import set_flat
from learning.training import evaluate

__all__ = ["EvalSummary", "federated_evaluate", "ServerEvaluator"]


@dataclass(frozen=True)
class EvalSummary:
    """Example-weighted means over the clients that answered."""

    loss: float | None
    accuracy: float | None
    train_loss: float | None
    per_client: dict[int, tuple[float, float, int]]


def federated_evaluate(grid: Grid, nodes: Sequence[int], params: np.ndarray, config: TrainConfig,
                       deadline_s: float) -> EvalSummary:
    """Ask ``nodes`` to evaluate ``params``; the weighted mean of what comes back.

    Replies are range-checked (:func:`core.messages.parse_eval_reply`) and each
    client's example count is capped at 3x the median (:class:`WeightPolicy`),
    so no client that claims a huge test set decides the federated score.
    """
    content = {n: train_instruction(params, config) for n in nodes}
    results: dict[int, tuple[float, float, int]] = {}
    train: list[tuple[float, int]] = []

    def on_reply(node: int, reply: Message) -> None:
        if reply.has_error():
            return
        try:
            parsed = parse_eval_reply(reply.content)
        except UpdateRejected:
            return
        results[node] = (parsed.loss, parsed.accuracy, parsed.num_examples)
        if parsed.train_loss is not None and parsed.train_examples > 0:
            train.append((parsed.train_loss, parsed.train_examples))

    collect(grid, push(grid, content, "evaluate", config.round), deadline_s, on_reply)
    if not results:
        return EvalSummary(None, None, None, {})
    losses, accs, counts = zip(*results.values(), strict=True)
    weights = _ROBUST.weights(counts)
    train_loss = (float(np.average([loss for loss, _ in train], weights=_ROBUST.weights([n for _, n in train])))
                  if train else None)
    return EvalSummary(float(np.average(losses, weights=weights)), float(np.average(accs, weights=weights)),
                       train_loss, results)


_ROBUST = WeightPolicy("median", median_cap=3.0)


class ServerEvaluator:
    """Scores flat parameters on the aggregator's held-out set."""

    def __init__(self, model_factory, test_set) -> None:
        self._model = model_factory()
        self._test = test_set

    def __call__(self, params: np.ndarray) -> tuple[float, float]:
        set_flat(self._model, params)
        result = evaluate(self._model, self._test)
        return float(result.loss), float(result.accuracy)
