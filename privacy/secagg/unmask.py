"""Server-side unmasking: rebuild secrets from shares and strip the masks off the sum.

For every client ``u`` whose masked input is in the sum the server rebuilds
its self-mask seed ``b_u``; for every client ``v`` that completed SHARE_KEYS
but not MASKED_INPUT it rebuilds ``v``'s mask private key and recomputes the
pairwise masks ``v`` shared with surviving neighbours (Bonawitz et al.,
CCS 2017, Fig. 4, round 4). Each rebuilt secret is verified (a commitment for
``b_u``, the advertised public key for ``s_v``); if a share is bad and spare
shares exist, the other subsets are tried before giving up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from privacy.secagg.errors import SecAggCryptoError
from privacy.secagg.graph import Graph
from privacy.secagg.keys import (
    PublicKeys,
    agree,
    pair_mask_key,
    public_of,
    self_mask_commitment,
    self_mask_key,
)
from privacy.secagg.messages import UnmaskReply
from privacy.secagg.prg import MaskExpander
from privacy.secagg.shamir import combine

__all__ = ["UnmaskPlan", "collect_shares", "rebuild_verified", "remove_masks"]


Shares = dict[int, dict[int, int]]


def collect_shares(replies: Mapping[int, UnmaskReply]) -> tuple[Shares, Shares]:
    """Regroup revealed shares by owner: ``owner -> {holder: share}``, per secret kind."""
    self_shares: Shares = {}
    key_shares: Shares = {}
    for holder, reply in replies.items():
        for s in reply.self_mask_shares:
            self_shares.setdefault(s.owner, {})[holder] = s.value
        for s in reply.mask_key_shares:
            key_shares.setdefault(s.owner, {})[holder] = s.value
    return self_shares, key_shares


def _subsets(points: Mapping[int, int], threshold: int) -> Iterator[Mapping[int, int]]:
    """All shares first, then (given spares) each leave-one-out subset, lazily."""
    yield points
    if len(points) > threshold:
        for skip in sorted(points)[:threshold]:
            yield {x: y for x, y in points.items() if x != skip}


def rebuild_verified(points: Mapping[int, int], threshold: int,
                     verify: Callable[[bytes], bool]) -> bytes:
    """Rebuild a secret from ``{x: y}`` and check it; retry without one share at a time.

    Raises
    ------
    SecAggCryptoError
        No tried subset yields a secret that passes ``verify``.
    """
    for subset in _subsets(points, threshold):
        try:
            secret = combine(subset, threshold)
        except SecAggCryptoError:
            continue
        if verify(secret):
            return secret
    raise SecAggCryptoError()


@dataclass(frozen=True)
class UnmaskPlan:
    """Everything the server needs to unmask one round's sum."""

    session: bytes
    bits: int
    threshold: int
    graph: Graph
    keys: Mapping[int, PublicKeys]
    commitments: Mapping[int, bytes]
    x_of: Mapping[int, int]
    survivors: frozenset[int]
    dropped: frozenset[int]


def _points(plan: UnmaskPlan, shares: Mapping[int, int]) -> dict[int, int]:
    return {plan.x_of[holder]: value for holder, value in shares.items()}


def _self_mask_seeds(plan: UnmaskPlan, shares: Mapping[int, Mapping[int, int]],
                     length: int) -> list[bytes]:
    seeds = []
    for u in sorted(plan.survivors):
        commitment = plan.commitments[u]

        def commits(s: bytes, u: int = u, c: bytes = commitment) -> bool:
            return self_mask_commitment(s, plan.session, u) == c

        seed = rebuild_verified(_points(plan, shares[u]), plan.threshold, commits)
        seeds.append(self_mask_key(seed, plan.session, u, length, plan.bits))
    return seeds


def _pair_mask_seeds(plan: UnmaskPlan, shares: Mapping[int, Mapping[int, int]],
                     length: int) -> tuple[list[bytes], list[bytes]]:
    """Masks survivors shared with dropped clients: ``(to add back, to subtract)``."""
    plus: list[bytes] = []
    minus: list[bytes] = []
    for v in sorted(plan.dropped):
        partners = sorted(plan.graph[v] & plan.survivors)
        if not partners:
            continue
        public = plan.keys[v].mask

        def owns(s: bytes, p: bytes = public) -> bool:
            return public_of(s) == p

        private = rebuild_verified(_points(plan, shares[v]), plan.threshold, owns)
        key = X25519PrivateKey.from_private_bytes(private)
        for u in partners:
            seed = pair_mask_key(agree(key, plan.keys[u].mask), plan.session, u, v, length, plan.bits)
            # u added this mask if u < v and subtracted it otherwise.
            (minus if u < v else plus).append(seed)
    return plus, minus


def remove_masks(acc: np.ndarray, plan: UnmaskPlan, self_shares: Mapping[int, Mapping[int, int]],
                 key_shares: Mapping[int, Mapping[int, int]]) -> None:
    """Strip every remaining mask from ``acc`` in place.

    Parameters
    ----------
    acc : np.ndarray
        Sum of the masked inputs of ``plan.survivors``.
    plan : UnmaskPlan
        The round's public data.
    self_shares, key_shares : Mapping[int, Mapping[int, int]]
        ``owner -> {holder: share}`` for self-mask seeds and mask keys.
    """
    length = acc.shape[0]
    plus, minus = _pair_mask_seeds(plan, key_shares, length)
    minus += _self_mask_seeds(plan, self_shares, length)
    MaskExpander(length, plan.bits).add_all(acc, plus, minus)
