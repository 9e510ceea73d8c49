"""``[hierarchy]``: edge aggregators between the devices and the aggregator.

With ``edges = E`` the federation's devices are split over ``E`` edge
aggregators (device ``i`` of ``N`` under edge ``i * E // N``: contiguous
blocks, as devices enrolled with their site's edge would be). A round samples
devices exactly as a flat run does; each edge trains its sampled devices and
sends the aggregator one partial sum (``aggregator.hierarchy``), so the
aggregator's FedAvg over the edges is flat FedAvg over the devices. What each
level learns and how to deploy an edge: ``docs/hierarchy.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scenarios.bounds import MAX_CLIENTS
from scenarios.parse import Bad, within

__all__ = ["HierarchySpec", "check_hierarchy"]


@dataclass(frozen=True)
class HierarchySpec:
    """``[hierarchy]``: how many edge aggregators the devices are split over (0: none, a flat federation)."""

    edges: int = 0

    def _check(self) -> None:
        within("edges", self.edges, 0, MAX_CLIENTS)

    @property
    def enabled(self) -> bool:
        """Whether the federation is a tree."""
        return self.edges > 0


def check_hierarchy(scenario: Any) -> None:
    """Refuse what a tree of partial sums cannot give flat FedAvg's model for, naming both keys.

    ``scenario``: a Scenario.
    """
    spec = scenario.hierarchy
    if spec.edges > scenario.federation.clients:
        raise Bad("hierarchy.edges", spec.edges, f"exceeds federation.clients = {scenario.federation.clients}: "
                   "an edge aggregator needs at least one device")
    culprit = (
        ("federation.weighting", scenario.federation.weighting,
         "[hierarchy] edges > 0: this weighting caps each count at a multiple of the round's median, which "
         "no edge knows before every edge has answered; use \"capped\" or \"uniform\"")
        if scenario.federation.weighting == "median" else
        ("strategy.name", scenario.strategy.name,
         "[hierarchy] edges > 0: a robust rule must see every update, and an edge sends only its "
         "devices' sum; use a FedAvg-family strategy")
        if scenario.strategy.robust else
        ("async.enabled", True, "[hierarchy] edges > 0 sends one sum per edge and round, and buffered "
         "asynchronous aggregation folds single replies as they come; choose one") if scenario.asynchronous.enabled else
        ("dp.enabled", True, "[hierarchy] edges > 0: differential privacy over a tree of edges is "
         "not supported yet (docs/hierarchy.md); run it flat") if scenario.dp.enabled else None)
    if culprit is not None:
        raise Bad(*culprit)
