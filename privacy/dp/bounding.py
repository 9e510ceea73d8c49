"""Bounding what clients send before DP-FedAvg sums it.

The privacy of DP-FedAvg rests on each client moving the sum by a bounded
amount (McMahan et al., ICLR 2018): the update by at most the clip norm
``C``, the adaptive-clipping count bit by at most ``1/2`` (Andrew et al.,
NeurIPS 2021). Clients are told to clip, but a client may lie, so the
aggregator enforces the bounds itself wherever it can see them: per update
under the central placement (:func:`fold_private_term`), and on the
securely summed count bit, the only figure it sees under secure aggregation
(:func:`bounded_sum`). Both are post-processing of what was sent and cost
no privacy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, runtime_checkable

import numpy as np

from core import aggregate
from core.errors import UpdateRejected
from privacy.dp.mechanisms import clip_factor, l2_norm

__all__ = ["CentredTerms", "fold_private_term", "fold_clipped", "bounded_sum", "bounded_bits"]


@runtime_checkable
class CentredTerms(Protocol):
    """A rule whose per-client influence is a bounded term centred away from 0 (centered clipping).

    DP's hook into the rule it wraps: the central placement clips, sums and
    noises :meth:`private_term` instead of the raw delta, so the noise covers
    the rule's own release, and clients are not told to clip their raw deltas
    first (that would shrink honest updates towards 0 before the rule centres
    them). Every other rule's term is the delta itself.
    """

    def private_term(self, update: np.ndarray) -> np.ndarray:
        """Return what DP clips, sums and noises for one client's delta."""
        ...

    def from_private_mean(self, mean_term: np.ndarray) -> np.ndarray:
        """Return what the rule's ``apply`` takes, from DP's noised mean of the terms (post-processing)."""
        ...


def fold_private_term(agg: aggregate.MeanState, update: np.ndarray, private_term: Callable[[np.ndarray], np.ndarray],
                      clip: float, tail: int) -> aggregate.MeanState:
    """Central placement: fold one checked payload, its private term clipped to ``clip``.

    ``private_term`` is the inner strategy's :meth:`CentredTerms.private_term`
    (or the delta itself for every other rule); the ``tail``
    coordinates after the model (the count bit) follow it unchanged into
    :func:`fold_clipped`, which clamps the bit.
    """
    size = agg.size - tail
    head = update[:size]
    term = private_term(head)
    if term is not head:
        update = np.concatenate([term, update[size:]]).astype(np.float32, copy=False)
    return fold_clipped(agg, update, clip, tail)


def fold_clipped(agg: aggregate.MeanState, update: np.ndarray, clip: float, tail: int) -> aggregate.MeanState:
    """``agg + clip(update)`` without allocating: the scale rides as the weight of the model part."""
    size = agg.size - tail
    head, total = update[:size], agg.total
    scale = np.float32(clip_factor(l2_norm(head), clip))
    scratch = agg.scratch if agg.scratch is not None else aggregate.block_scratch(size)
    aggregate.scaled_add(total[:size], head, scale, scratch)
    if tail:
        total[size] += np.float32(min(0.5, max(-0.5, float(update[size]))))
    return aggregate.MeanState(total, agg.weight + 1.0, agg.count + 1, scratch)


def bounded_sum(partial: aggregate.MeanState, size: int, tail: int, count_share_std: float) -> aggregate.MeanState:
    """Check a securely summed partial aggregate and bound its count bit (when ``tail``) bounded.

    Each client weighs 1, so the sum's weight must equal its count; anything
    else is refused. ``count_share_std`` is the std of one client's noise
    share on the count bit (0 under the central placement).

    Raises
    ------
    UpdateRejected
        A sum of another size, or whose weight is not its count.
    """
    if partial.size != size or abs(partial.weight - partial.count) > 0.5:
        raise UpdateRejected(f"secure sum of size {partial.size}, weight {partial.weight} for "
                           f"{partial.count} clients: expected size {size} and weight 1 per client")
    total = aggregate.check_update(partial.total, size).copy()
    if tail:
        noise = count_share_std * math.sqrt(partial.count)
        total[-1] = bounded_bits(float(total[-1]), partial.count, noise)
    return replace(partial, total=total)


def bounded_bits(summed: float, count: int, noise_std: float) -> float:
    """Clamp a securely summed count bit to what ``count`` honest clients can send.

    Each honest bit is ``+-1/2`` (plus, distributed, a noise share): the sum
    lies in ``[-count/2, count/2]`` widened by six standard deviations of the
    summed noise shares, which an honest sum leaves with probability 2e-9.
    Clamping is post-processing, so it costs no privacy.
    """
    bound = count / 2.0 + 6.0 * noise_std
    return min(bound, max(-bound, summed))
