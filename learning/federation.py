"""The scenario's federated data set, built once per process and reused.

Every part of one process that needs the federation (the clients of an
in-process run, the server's held-out test set, a warm deployment worker)
asks here, so the data set is read and partitioned once.
"""

from __future__ import annotations

import functools

from learning.datasets import Federation, build_federation
from scenarios.schema import DataSpec, Scenario

__all__ = ["cached_federation"]


def cached_federation(scenario: Scenario) -> Federation:
    """The scenario's federated data set, built once per process."""
    return _federation(scenario.data, scenario.federation.clients, scenario.seed)


@functools.lru_cache(maxsize=2)
def _federation(spec: DataSpec, num_clients: int, seed: int) -> Federation:
    return build_federation(spec, num_clients, seed)
