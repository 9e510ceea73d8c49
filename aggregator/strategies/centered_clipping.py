"""Centered clipping with server momentum and bucketing, as a one-pass streaming fold.

Centered clipping (Karimireddy, He & Jaggi, "Learning from History for
Byzantine Robust Optimization", ICML 2021, Algorithm 2 with L = 1 iteration)
clips every update around the previous aggregate::

    v_t = v_{t-1} + 1/k * sum_j clip(y_j - v_{t-1}, tau),   clip(z, tau) = z * min(1, tau / ||z||)

Its robustness comes from momentum: each worker sends
``m_i = (1 - beta) * x_i + beta * m_i^{prev}``. Federated clients are sampled
and stateless, so every client starts from the server's momentum
(``m_i^{prev} = v_{t-1}``), which makes ``m_i - v_{t-1} = (1 - beta)(x_i - v_{t-1})``:
the server computes it from the plain delta ``x_i`` and keeps ``v`` in
``ServerState.slots["momentum"]``. ``beta = 0`` is centered clipping without
momentum.

Bucketing (Karimireddy, He & Jaggi, "Byzantine-Robust Learning on
Heterogeneous Datasets via Bucketing", ICLR 2022, Algorithm 1) averages the
updates in buckets of ``s`` before the robust rule, which shrinks the spread
of honest, non-IID updates. The paper permutes the updates at random first;
a stream cannot be permuted without holding it, so the buckets are
consecutive *arrivals*: arrival order already depends on client speed and
network, not on the client ids an attacker controls. A short last bucket
counts like the others.

The fold keeps three model-sized buffers (the centre, the sum of clipped
differences and the open bucket): O(model) memory, one pass over the replies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Self

import numpy as np

from core.aggregate import check_update
from core.strategy import ServerState, Strategy

__all__ = ["CenteredClipping", "CCState"]


@dataclass(frozen=True)
class CCState:
    """Running state of one round's centered-clipping fold.

    Attributes
    ----------
    center : np.ndarray
        ``v_{t-1}``, the previous momentum (read only).
    total : np.ndarray
        Sum of the clipped bucket differences folded so far.
    bucket : np.ndarray
        Sum of the deltas of the open (not yet full) bucket.
    fill : int
        Deltas in the open bucket.
    buckets : int
        Closed buckets folded into ``total``.
    count : int
        Deltas folded in, in all.
    marks : dict[int, dict[str, float]]
        Arrival index -> ``{"clipped": 1.0}`` for clients whose bucket was clipped.
    """

    center: np.ndarray
    total: np.ndarray
    bucket: np.ndarray
    fill: int = 0
    buckets: int = 0
    count: int = 0
    marks: dict[int, dict[str, float]] = field(default_factory=dict, compare=False)

    @property
    def size(self) -> int:
        """Number of parameters of the model aggregated."""
        return int(self.total.shape[0])


@dataclass(frozen=True)
class CenteredClipping(Strategy[CCState]):
    """Centered clipping around the server momentum, with bucketing.

    Parameters
    ----------
    clip_radius : float
        ``tau``, the L2 radius of the clip around the previous momentum.
    bucket_size : int
        ``s``, deltas averaged per bucket (1: no bucketing).
    momentum : float
        ``beta`` in [0, 1).
    server_lr : float
        Step: ``x <- x + server_lr * v_t``.
    """

    clip_radius: float = 1.0
    bucket_size: int = 2
    momentum: float = 0.9
    server_lr: float = 1.0
    name: str = "centered_clipping"
    center: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Refuse a non-positive or infinite radius, a bucket size below 1, a momentum outside [0, 1)."""
        if not 0 < self.clip_radius < float("inf"):
            raise ValueError(f"clip_radius must be a positive finite number, got {self.clip_radius}")
        if self.bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {self.bucket_size}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")

    def for_round(self, state: ServerState) -> Self:
        """Return this strategy centred on the momentum ``state`` carries (zero before round 1)."""
        return replace(self, center=state.slots.get("momentum"))

    def new_aggregate(self, size: int) -> CCState:
        """Return an empty state around this round's centre (zeros when it has none of ``size`` values)."""
        center = self.center if self.center is not None and self.center.size == size else np.zeros(size, np.float32)
        return CCState(center=center, total=np.zeros(size, np.float32), bucket=np.zeros(size, np.float32))

    def accumulate(self, agg: CCState, update: np.ndarray, num_examples: float, *,  # noqa: ARG002 (Strategy's)
                   checked: bool = False) -> CCState:
        """Add one delta to the open bucket; a full bucket is clipped and folded (equal weights)."""
        update = check_update(update, agg.size, finite=not checked)
        np.add(agg.bucket, update, out=agg.bucket)
        state = replace(agg, fill=agg.fill + 1, count=agg.count + 1)
        return self._close_bucket(state) if state.fill == self.bucket_size else state

    def _close_bucket(self, agg: CCState) -> CCState:
        diff = np.float32((1.0 - self.momentum) / agg.fill) * agg.bucket - np.float32(1.0 - self.momentum) * agg.center
        clipped = clip_around(diff, self.clip_radius)
        np.add(agg.total, clipped, out=agg.total)
        if clipped is not diff:
            agg.marks.update({i: {"clipped": 1.0} for i in range(agg.count - agg.fill, agg.count)})
        agg.bucket.fill(0.0)
        return replace(agg, fill=0, buckets=agg.buckets + 1)

    def finalize(self, agg: CCState, rng: np.random.Generator) -> np.ndarray:  # noqa: ARG002 (Strategy's)
        """``v_t = v_{t-1} + mean of the clipped bucket differences`` (the short last bucket included)."""
        if agg.count == 0:
            raise ValueError("cannot finalize an empty aggregate: no update was added")
        if agg.fill:
            agg = self._close_bucket(replace(agg, total=agg.total.copy(), bucket=agg.bucket.copy()))
        return (agg.center + agg.total / np.float32(agg.buckets)).astype(np.float32, copy=False)

    def private_term(self, update: np.ndarray) -> np.ndarray:
        """One client's clipped difference ``clip((1 - beta)(x_i - v_{t-1}), tau)``, for central DP.

        Under a client-level DP wrapper each client is its own bucket (the
        scenario requires ``bucket_size = 1`` there: buckets of consecutive
        arrivals would let one client's presence shift every later bucket), and
        the wrapper clips this term again at its ``C``, sums, noises and divides
        by its fixed denominator; :meth:`from_private_mean` adds the centre back.
        One client then moves the release by at most ``min(tau, C) / m``.
        """
        center = self.center if self.center is not None and self.center.size == update.size \
            else np.zeros(update.size, np.float32)
        diff = np.float32(1.0 - self.momentum) * (update - center)
        return clip_around(diff.astype(np.float32, copy=False), self.clip_radius)

    def from_private_mean(self, mean_term: np.ndarray) -> np.ndarray:
        """``v_t = v_{t-1} + `` the noised mean of the clipped differences (``v_{t-1}`` was released)."""
        if self.center is None or self.center.size != mean_term.size:
            return mean_term
        released: np.ndarray = self.center + mean_term
        return released.astype(np.float32, copy=False)

    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """``x <- x + server_lr * v_t``; ``v_t`` becomes the next round's centre."""
        params = state.params + np.float32(self.server_lr) * mean_delta
        return state.advanced(params.astype(np.float32, copy=False), momentum=mean_delta.astype(np.float32))



def clip_around(diff: np.ndarray, radius: float) -> np.ndarray:
    """``diff * min(1, radius / ||diff||)``: ``diff`` itself when inside the ball, else a scaled copy."""
    norm = float(np.linalg.norm(diff))
    if norm <= radius:
        return diff
    return diff * np.float32(radius / norm)
