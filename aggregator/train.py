"""The train step of a round: send the global model, fold updates as they arrive.

A train workflow (its types are in :mod:`core.train`) turns (sampled clients,
global model) into a running aggregate plus one
:class:`~core.records.ClientRecord` per sampled client. The plain workflow here
folds each validated reply into the strategy's monoid the
moment it is pulled; secure aggregation supplies another workflow with the
same shape (``privacy.secagg``), so the round loop has no ``if secagg:``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid

from aggregator.collect import collect, push
from core.aggregate import MeanState, widened
from core.compress import Codec
from core.errors import UpdateRejected
from core.instructions import broadcast_of, train_instruction
from core.layouts import ParamLayout
from core.outcomes import error_outcome
from core.records import ClientRecord
from core.replies import parse_train_reply
from core.status import ClientStatus
from core.strategy import Strategy
from core.train import TrainOutcome, TrainRequest
from core.weighting import WeightPolicy
from core.wire import wire_bytes

__all__ = ["PlainTrain"]


def _label(node: int) -> str:
    return str(node)


class PlainTrain:
    """Send ``train`` instructions, validate and fold replies as they arrive.

    Parameters
    ----------
    weighting : WeightPolicy
        How much each accepted update counts (``[federation] weighting``); a
        rule that needs the round's median folds once every reply is in.
    max_update_ratio : float
        An update whose L2 norm exceeds ``max_update_ratio * max(1, |model|)``
        is rejected (a finite update of 3e38s would overflow the sum).
    accumulate : str
        What a running sum of updates accumulates in (``[federation] accumulate``): float32 or float64.
    """

    def __init__(self, weighting: WeightPolicy | None = None, max_update_ratio: float = 10.0,
                 accumulate: str = "float32") -> None:
        self.weighting = weighting or WeightPolicy()
        self.max_update_ratio = max_update_ratio
        self.accumulate = accumulate

    def __call__(self, grid: Grid, request: TrainRequest, strategy: Strategy[Any]) -> TrainOutcome[Any]:
        """Push the round's train instruction to ``request.nodes`` and fold each reply as it arrives.

        A node with no reply within ``request.deadline_s`` is recorded
        ``dropped``. The outcome's aggregate is ``None`` when no update was
        folded; its ``train_loss`` is the weighted mean of the clients' losses.
        """
        content = train_instruction(request.state.params, request.config, request.layout)
        contents = {n: content for n in request.nodes}
        agg = strategy.new_aggregate(request.state.params.size)
        if isinstance(agg, MeanState):
            agg = widened(agg, self.accumulate)
        outcome = TrainOutcome(aggregate=agg)
        sent = wire_bytes(content)
        outcome.bytes_out = sent * len(request.nodes)
        started = time.monotonic()
        losses: list[tuple[float, int]] = []
        bound = self.max_update_ratio * max(1.0, float(np.linalg.norm(request.state.params)))
        fold = _FoldEachReply(strategy, request, outcome, losses, started, agg.size, self.weighting, bound,
                              codec=Codec.from_config(request.config), reference=_reference(request))
        missing = collect(grid, push(grid, contents, "train", request.server_round), request.deadline_s, fold)
        for node in sorted(missing):
            outcome.clients.append(ClientRecord(client=_label(node), outcome=ClientStatus.DROPPED, stage="train",
                                                reason=f"no reply within {request.deadline_s:g} s"))
        fold.flush()
        outcome.clients = [replace(c, bytes_out=sent) for c in outcome.clients]
        if outcome.aggregate is not None and outcome.aggregate.count == 0:
            outcome.aggregate = None
        if losses:
            weights = self.weighting.weights([n for _, n in losses])
            outcome.train_loss = float(np.average([loss for loss, _ in losses], weights=weights))
        return outcome


def _reference(request: TrainRequest) -> np.ndarray:
    """Return the model the clients start from: the global model as the broadcast's precision leaves it.

    A full-weight reply is made a delta against it.
    """
    params = request.state.params
    return broadcast_of(request.config).roundtrip(params, request.layout or ParamLayout.flat(params.size))


@dataclass
class _FoldEachReply:
    """Per-reply callback: validate, fold, record (one bad client never kills a round)."""

    strategy: Strategy[Any]
    request: TrainRequest
    outcome: TrainOutcome[Any]
    losses: list[tuple[float, int]]
    started: float
    size: int  # of an update: the model's, plus what the strategy appends (DP's count bit)
    weighting: WeightPolicy = field(default_factory=WeightPolicy)
    max_norm: float = float("inf")
    codec: Codec | None = None  # the round's uplink compression: the server decodes with its own
    reference: np.ndarray | None = None
    pending: list[tuple[int, np.ndarray, int]] = field(default_factory=list)

    def __call__(self, node: int, reply: Message) -> None:
        elapsed = time.monotonic() - self.started
        if reply.has_error():  # a node that is gone (dropped), or a task that raised (failed)
            outcome, reason = error_outcome(reply.error)
            self.outcome.clients.append(ClientRecord(client=_label(node), outcome=outcome, stage="train",
                                                     reason=reason, duration_s=elapsed))
            return
        nbytes = wire_bytes(reply.content)
        self.outcome.bytes_in += nbytes
        try:
            parsed = parse_train_reply(reply.content, self.size, self.request.max_update_bytes,
                                       reference=self.reference, layout=self.request.layout, codec=self.codec)
            self._fold(node, parsed.delta, parsed.num_examples)
        except UpdateRejected as exc:
            self.outcome.clients.append(ClientRecord(client=_label(node), outcome=ClientStatus.REJECTED, stage="train",
                                                     reason=str(exc), duration_s=elapsed, bytes_in=nbytes))
            return
        loss = _finite(parsed.metrics.get("train-loss"))
        if loss is not None:
            self.losses.append((loss, parsed.num_examples))
        self.outcome.clients.append(ClientRecord(
            client=_label(node), outcome=ClientStatus.OK, num_examples=parsed.num_examples, train_loss=loss,
            duration_s=_finite(parsed.metrics.get("duration-s")) or elapsed, bytes_in=nbytes,
            metrics={k: v for k, v in parsed.metrics.items() if isinstance(v, (int, float))}))


    def _fold(self, node: int, delta: np.ndarray, num_examples: int) -> None:
        """Fold now when the weight is known; else keep the (zero-copy) update for :meth:`flush`."""
        with np.errstate(over="ignore"):
            norm = float(np.sqrt(np.dot(delta, delta)))
        if not norm <= self.max_norm:
            raise UpdateRejected(f"update norm {norm:.4g} exceeds the bound {self.max_norm:.4g} "
                                 "(max_update_ratio x model norm)")
        if not self.weighting.streams:
            self.pending.append((node, delta, num_examples))
            return
        self.outcome.aggregate = self.strategy.accumulate(self.outcome.aggregate, delta,
                                                          self.weighting.weight(num_examples), checked=True)

    def flush(self) -> None:
        """Fold the updates kept back, weighted now that the round's counts are all known."""
        weights = self.weighting.weights([n for _, _, n in self.pending])
        for (node, delta, _), weight in zip(self.pending, weights, strict=True):
            try:
                self.outcome.aggregate = self.strategy.accumulate(self.outcome.aggregate, delta, weight, checked=True)
            except UpdateRejected as exc:
                self.outcome.clients = [replace(c, outcome=ClientStatus.REJECTED, stage="train", reason=str(exc))
                                        if c.client == _label(node) else c for c in self.outcome.clients]
        self.pending.clear()


def _finite(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value):
        return float(value)
    return None
