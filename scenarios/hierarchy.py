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

__all__ = ["HierarchySpec", "check_hierarchy", "MIN_SECURE_EDGES"]


@dataclass(frozen=True)
class HierarchySpec:
    """``[hierarchy]``: how many edge aggregators the devices are split over (0: none, a flat federation).

    ``secure_across_edges`` sums the edges' partial sums by secure aggregation
    too, so the aggregator learns only the global sum (``[secagg]`` secures
    each edge's own cohort: it must be enabled).
    """

    edges: int = 0
    secure_across_edges: bool = False

    def _check(self) -> None:
        within("edges", self.edges, 0, MAX_CLIENTS)
        if self.secure_across_edges and not self.edges:
            raise Bad("secure_across_edges", True, "needs edges > 0: a flat federation has no edges to secure")

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
         "[hierarchy] edges > 0 runs a robust rule at each edge, over its own cohort, and this one cannot: "
         + _EDGE_RULES_WHY.get(scenario.strategy.name, "")
         + "; use \"median\" or \"trimmed_mean\" (each edge's cohort filtered, FedAvg over the edges)")
        if scenario.strategy.robust and scenario.strategy.name not in EDGE_RULES else
        ("async.enabled", True, "[hierarchy] edges > 0 sends one sum per edge and round, and buffered "
         "asynchronous aggregation folds single replies as they come; choose one") if scenario.asynchronous.enabled
        else None)
    if culprit is not None:
        raise Bad(*culprit)
    if spec.secure_across_edges:
        if not scenario.secagg.enabled:
            raise Bad("hierarchy.secure_across_edges", True, "needs [secagg] enabled = true: an edge that saw its "
                       "devices' updates in clear would protect from the aggregator what it sees itself; [secagg] "
                       "secures each edge's cohort, and its settings (bits, clip_range, threshold) the sum across")
        if spec.edges < MIN_SECURE_EDGES:
            raise Bad("hierarchy.edges", spec.edges, f"hierarchy.secure_across_edges = true needs at least "
                       f"{MIN_SECURE_EDGES} edges: with two, each learns the other's sum from the next model")


#: The robust rules an edge runs over its own cohort (``aggregator.hierarchy.robust``): stateless, each update 1.
EDGE_RULES = frozenset({"median", "trimmed_mean"})
_EDGE_RULES_WHY = {
    "krum": "its num_byzantine bound is per round, and a Byzantine minority of the round can be a majority of "
            "one edge's cohort",
    "centered_clipping": "its centre is the previous round's aggregate, which no edge holds",
}

#: The fewest edges a secure sum across edges hides one edge's sum among: with 2, each edge subtracts its own.
MIN_SECURE_EDGES = 3
