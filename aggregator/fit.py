"""The fit step of a round: send the global model, fold updates as they arrive.

A fit workflow turns (sampled clients, global model) into a running aggregate
plus one :class:`~aggregator.store.ClientRecord` per sampled client. The plain
workflow here folds each validated reply into the strategy's monoid the
moment it is pulled; secure aggregation supplies another workflow with the
same shape (``privacy.secagg``), so the round loop has no ``if secagg:``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid

from aggregator import core
from aggregator.collect import collect, push
from aggregator.errors import UpdateRejected
from aggregator.messages import TrainConfig, content_bytes, parse_train_reply, train_instruction
from aggregator.store import ClientRecord
from aggregator.strategies.base import ServerState, Strategy

__all__ = ["FitRequest", "FitOutcome", "FitWorkflow", "PlainFit"]


@dataclass(frozen=True)
class FitRequest:
    """What a fit workflow needs for one round."""

    round: int
    nodes: Sequence[int]
    state: ServerState
    config: TrainConfig
    deadline_s: float
    max_update_bytes: int


@dataclass
class FitOutcome:
    """What one round's fit step produced."""

    aggregate: core.MeanState | None
    clients: list[ClientRecord] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    train_loss: float | None = None
    secagg: dict[str, Any] | None = None


class FitWorkflow(Protocol):
    def __call__(self, grid: Grid, request: FitRequest, strategy: Strategy) -> FitOutcome: ...


def _label(node: int) -> str:
    return str(node)


class PlainFit:
    """Send ``train`` instructions, validate and fold replies as they arrive."""

    def __call__(self, grid: Grid, request: FitRequest, strategy: Strategy) -> FitOutcome:
        content = train_instruction(request.state.params, request.config)
        contents = {n: content for n in request.nodes}
        outcome = FitOutcome(aggregate=strategy.new_aggregate(request.state.params.size))
        outcome.bytes_out = content_bytes(content) * len(request.nodes)
        started = time.monotonic()
        losses: list[tuple[float, int]] = []
        fold = _Folder(strategy, request, outcome, losses, started)
        missing = collect(grid, push(grid, contents, "train", request.round), request.deadline_s, fold)
        for node in sorted(missing):
            outcome.clients.append(ClientRecord(client=_label(node), outcome="dropped", stage="train",
                                                reason=f"no reply within {request.deadline_s:g} s"))
        if outcome.aggregate is not None and outcome.aggregate.count == 0:
            outcome.aggregate = None
        if losses:
            outcome.train_loss = float(np.average([l for l, _ in losses], weights=[n for _, n in losses]))
        return outcome


@dataclass
class _Folder:
    """Per-reply callback: validate, fold, record (one bad client never kills a round)."""

    strategy: Strategy
    request: FitRequest
    outcome: FitOutcome
    losses: list[tuple[float, int]]
    started: float

    def __call__(self, node: int, reply: Message) -> None:
        elapsed = time.monotonic() - self.started
        if reply.has_error():
            self.outcome.clients.append(ClientRecord(client=_label(node), outcome="error", stage="train",
                                                     reason=str(reply.error.reason), duration_s=elapsed))
            return
        nbytes = content_bytes(reply.content)
        self.outcome.bytes_in += nbytes
        try:
            size = self.outcome.aggregate.size  # model size, plus what the strategy appends (DP's count bit)
            parsed = parse_train_reply(reply.content, size, self.request.max_update_bytes)
            self.outcome.aggregate = accumulate(self.strategy, self.outcome.aggregate, parsed.delta,
                                                parsed.num_examples, parsed.metrics)
        except UpdateRejected as exc:
            self.outcome.clients.append(ClientRecord(client=_label(node), outcome="rejected", stage="train",
                                                     reason=str(exc), duration_s=elapsed, bytes_in=nbytes))
            return
        loss = _finite(parsed.metrics.get("train-loss"))
        if loss is not None:
            self.losses.append((loss, parsed.num_examples))
        self.outcome.clients.append(ClientRecord(
            client=_label(node), outcome="ok", num_examples=parsed.num_examples, train_loss=loss,
            duration_s=_finite(parsed.metrics.get("duration-s")) or elapsed, bytes_in=nbytes,
            metrics={k: v for k, v in parsed.metrics.items() if isinstance(v, (int, float))}))


def accumulate(strategy: Strategy, agg: core.MeanState, delta: np.ndarray, num_examples: int,
               metrics: Mapping[str, Any]) -> core.MeanState:
    """Fold one decoded (hence already validated) update."""
    return strategy.accumulate(agg, delta, num_examples, checked=True)


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
        return float(value)
    return None
