"""Aggregate states of robust rules: a buffer of every update, and per-client marks.

The weighted mean (:mod:`core.aggregate`) is a monoid over one running sum.
Order statistics (coordinate-wise median, trimmed mean) and distance-based
selection (Krum) are not sum-decomposable: they need every update at once, so
their aggregate state is an :class:`UpdateBuffer` holding the list, and its
type says so (memory O(clients x model), unlike the mean's O(model)).

Both kinds of robust state carry ``marks``: per arrival index (the n-th update
folded), what the rule did to that client's update (``{"clipped": 1.0}``,
``{"rejected": 1.0}``, ``{"trimmed": 0.4}``), which the round loop copies into
the client records (``aggregator.rounds``, ``_marked_clients``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from core.aggregate import check_update

__all__ = ["UpdateBuffer", "Marked", "empty_buffer", "buffer_add", "buffer_merge"]


@runtime_checkable
class Marked(Protocol):
    """An aggregate state that says what it did to each client's update."""

    marks: dict[int, dict[str, float]]


@dataclass(frozen=True)
class UpdateBuffer:
    """Every update of a round, kept for rules that need them all.

    Attributes
    ----------
    size : int
        Model size: every update has this many float32 values.
    updates : list[np.ndarray]
        The updates in arrival order (owned copies).
    weights : list[float]
        Their example counts, as reported (robust rules ignore them).
    marks : dict[int, dict[str, float]]
        Filled by the rule when it finalizes: arrival index -> what it did.
    """

    size: int
    updates: list[np.ndarray] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    marks: dict[int, dict[str, float]] = field(default_factory=dict, compare=False)

    @property
    def count(self) -> int:
        """Number of updates held."""
        return len(self.updates)

    def stacked(self) -> np.ndarray:
        """Stack the updates into one ``(count, size)`` float32 matrix."""
        return np.stack(self.updates).astype(np.float32, copy=False)


def empty_buffer(size: int) -> UpdateBuffer:
    """Return an empty buffer for a model of ``size`` parameters."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    return UpdateBuffer(size=size)


def buffer_add(buffer: UpdateBuffer, update: np.ndarray, weight: float, *, checked: bool = False) -> UpdateBuffer:
    """Keep a copy of one validated update (consumes ``buffer``, like :func:`core.aggregate.add`)."""
    update = check_update(update, buffer.size, finite=not checked)
    # A copy: the decoded update may be a view of the reply's bytes.
    buffer.updates.append(np.array(update, dtype=np.float32, copy=True))
    buffer.weights.append(float(weight))
    return UpdateBuffer(buffer.size, buffer.updates, buffer.weights, buffer.marks)


def buffer_merge(a: UpdateBuffer, b: UpdateBuffer) -> UpdateBuffer:
    """Both buffers' updates, ``a``'s first (consumes ``a``)."""
    if a.size != b.size:
        raise ValueError(f"cannot merge buffers of sizes {a.size} and {b.size}")
    a.updates.extend(b.updates)
    a.weights.extend(b.weights)
    return UpdateBuffer(a.size, a.updates, a.weights, a.marks)

