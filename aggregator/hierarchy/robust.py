"""A robust rule at each edge, FedAvg over the edges (``[strategy]`` a robust rule under ``[hierarchy]``).

A rule that ranks or trims updates (coordinate-wise median, trimmed mean)
must see every update, and an edge sends one sum. So the rule runs where the
updates are, at each edge, over its own cohort: the edge sends its robust
aggregate ``m_e`` as a sum ``n_e * m_e`` with weight ``n_e`` (its updates,
each weighing 1 as the rules weigh them), and the aggregator takes FedAvg of
the edges' robust aggregates, ``sum_e n_e m_e / sum_e n_e``, then steps the
model as the rule does (``server_lr``).

This is not the flat rule: the median of medians is not the median. What it
gives is each edge's cohort filtered by the rule before anything leaves the
edge, so Byzantine devices are outvoted within their own edge, and an edge
whose devices are all honest sends their clean aggregate. An edge itself is
checked as any edge is (its weight is its count, its mean within
``max_update_ratio``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.aggregate import MeanState
from core.buffer import UpdateBuffer
from core.strategy import MeanStrategy, ServerState, Strategy, describe

__all__ = ["EdgeRobust", "edge_strategy", "as_partial_sum"]


@dataclass(frozen=True)
class EdgeRobust(MeanStrategy):
    """FedAvg over the edges' robust aggregates; ``rule`` runs at each edge and steps the model.

    Parameters
    ----------
    rule : Strategy
        The robust rule (its aggregate an :class:`~core.buffer.UpdateBuffer`).
    """

    rule: Strategy[Any] = field(repr=False)
    name: str = "robust-at-edges"
    at_edges: dict[str, Any] = field(default_factory=dict)  # the rule's settings, as the run records them

    def __post_init__(self) -> None:
        """Name it after its rule (``trimmed_mean@edges``), and keep the rule's settings for the run's record."""
        object.__setattr__(self, "name", f"{self.rule.name}@edges")
        object.__setattr__(self, "at_edges", describe(self.rule))

    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """Step the model as the rule does, by the mean of the edges' robust aggregates."""
        return self.rule.apply(state, mean_delta)


def edge_strategy(strategy: Strategy[Any]) -> Strategy[Any]:
    """Return the strategy an edge folds its devices with: the robust rule itself, else the round's strategy."""
    return strategy.rule if isinstance(strategy, EdgeRobust) else strategy


def as_partial_sum(rule: Strategy[Any], agg: UpdateBuffer, dtype: str = "float32") -> MeanState:
    """Return an edge's robust aggregate of ``agg`` as a partial sum: ``n * m`` with weight and count ``n``.

    ``rule.finalize`` draws nothing at random (the robust rules are deterministic).
    """
    mean = rule.finalize(agg, np.random.default_rng(0)).astype(dtype)
    return MeanState(mean * np.asarray(agg.count, dtype=dtype), float(agg.count), agg.count)
