"""Who shares with whom: the complete graph or a random k-regular Harary graph.

Bonawitz et al. (CCS 2017) mask every pair of clients: O(n) work per client
and O(n^2) for the server. Bell et al. (SecAgg+, CCS 2020) mask only along a
sparse random graph of degree O(log n); their practical variant is a Harary
graph ``H(k, n)`` with randomly permuted labels, which is what this builds.
The permutation is keyed by a 32-byte seed that the server draws and
broadcasts, so every client derives the same graph and can check its own
neighbourhood.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

__all__ = ["Graph", "build_graph", "closed", "complete_graph", "harary_graph", "neighbours"]

Graph = Mapping[int, frozenset[int]]


def complete_graph(ids: Sequence[int]) -> dict[int, frozenset[int]]:
    """Everyone is everyone else's neighbour."""
    everyone = frozenset(ids)
    return {u: everyone - {u} for u in ids}


def _shuffled(ids: Sequence[int], seed: bytes) -> list[int]:
    return sorted(ids, key=lambda u: hashlib.sha256(seed + u.to_bytes(8, "big")).digest())


def _offsets(n: int, degree: int) -> list[int]:
    if not 2 <= degree < n or (degree * n) % 2:
        raise ValueError(f"no {degree}-regular Harary graph on {n} nodes")
    offsets = [o for h in range(1, degree // 2 + 1) for o in (h, -h)]
    return offsets + [n // 2] if degree % 2 else offsets


def harary_graph(ids: Sequence[int], degree: int, seed: bytes) -> dict[int, frozenset[int]]:
    """Harary graph ``H(degree, n)`` on a seeded random ordering of ``ids``.

    Position ``p`` links to ``p +- 1 .. p +- degree // 2`` and, for odd
    ``degree`` (then ``n`` is even), to the opposite position ``p + n/2``.
    """
    n, offsets = len(ids), _offsets(len(ids), degree)
    order = _shuffled(ids, seed)
    return {u: frozenset(order[(p + o) % n] for o in offsets) for p, u in enumerate(order)}


def neighbours(kind: str, ids: Sequence[int], degree: int, seed: bytes, node: int) -> frozenset[int]:
    """``node``'s neighbours in :func:`build_graph` ``(kind, ids, degree, seed)``, alone."""
    if kind == "complete" or degree >= len(ids) - 1:
        return frozenset(ids) - {node}
    n, offsets = len(ids), _offsets(len(ids), degree)
    order = _shuffled(ids, seed)
    p = order.index(node)
    return frozenset(order[(p + o) % n] for o in offsets)


def build_graph(kind: str, ids: Sequence[int], degree: int, seed: bytes) -> dict[int, frozenset[int]]:
    """Build the graph of one round; ``"kregular"`` with ``degree = n - 1`` is complete."""
    if kind == "complete" or degree >= len(ids) - 1:
        return complete_graph(ids)
    return harary_graph(ids, degree, seed)


def closed(graph: Graph, u: int) -> frozenset[int]:
    """``u``'s closed neighbourhood (its neighbours and itself): its share holders."""
    return graph[u] | {u}
