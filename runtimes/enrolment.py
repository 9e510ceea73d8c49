"""Simulation enrolment: the secure-aggregation identities of a simulated federation's virtual nodes.

Both simulation engines (in-process, ``runtimes.simulation``; Flower's Ray
simulation, ``runtimes.ray_engine``) enrol their nodes here, so neither
imports the other.
"""

from __future__ import annotations

from privacy.secagg.identity import node_config
from scenarios.schema import Scenario

__all__ = ["secagg_identities"]


def secagg_identities(scenario: Scenario) -> dict[int, dict[str, str]]:
    """Return each virtual node's secure-aggregation node config, by node id; empty without secure aggregation.

    Every virtual node (id ``partition + 1``) gets its own identity key, the
    directory of all of them and the scenario's threat model through its node
    config (a deployment's nodes get theirs from their operator).
    """
    if not scenario.secagg.enabled:
        return {}
    return node_config(range(1, scenario.federation.clients + 1), scenario.secagg.threat_model)
