"""The statistics pass of ``[data] standardize = "federated"``, on the server (:mod:`learning.standardize`).

Before round 1 the sampled clients send their features' count-weighted
moments through the run's own fit workflow (plain, or secure aggregation,
where the server sees only the sum), as if they were a round's updates of a
``2 d + 1`` model. The pass repeats at a larger public scale while some
client reports values beyond the clip range. The result travels in every
later instruction. A resumed run takes the pass again (the devices' data may
have changed since); the pass and its outcome are in the run's log.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from flwr.serverapp import Grid

from aggregator.fit import PlainFit
from aggregator.step import train_config
from aggregator.store import RunStore
from aggregator.strategies import FedAvg
from core.fit import FitOutcome, FitRequest, FitWorkflow
from core.strategy import ServerState
from core.weighting import WeightPolicy
from learning.standardize import INFO_KEY, LIMIT_KEY, PASS_KEY, SCALES, Standardization, standardized
from learning.task import load_task
from privacy.secagg.fit import SecAggFit
from scenarios.schema import Scenario

__all__ = ["StatisticsPassFailed", "federated_standardization", "statistics_fit", "standardize_run"]


class StatisticsPassFailed(RuntimeError):
    """No client answered the statistics pass: the run cannot standardise its features."""


def statistics_fit(scenario: Scenario, features: int) -> tuple[FitWorkflow, float]:
    """The pass's fit workflow and the largest value a statistic may take.

    Secure aggregation when the run has it (its clip range bounds the values, on a 64-bit ring);
    otherwise the plain fit, whose norm bound admits exactly the honest
    vectors (every value within 1).
    """
    if scenario.secagg.enabled:
        # a 64-bit ring: the vector is small, and each value is weighted by count / max_weight (often
        # 1e-2 or less), which a 32-bit ring's steps would round visibly in E[x^2] - E[x]^2
        return SecAggFit(replace(scenario.secagg, bits=64)), min(1.0, scenario.secagg.clip_range)
    fed = scenario.federation
    policy = WeightPolicy(fed.weighting, median_cap=fed.median_cap, max_examples=fed.max_examples)
    return PlainFit(policy, max_update_ratio=math.sqrt(2 * features + 1) * 1.001), 1.0  # float32 rounding


def federated_standardization(grid: Grid, scenario: Scenario, store: RunStore, run_id: str,
                              features: int) -> Standardization:
    """Run the pass over this round's sample of clients; log it; return the features' mean and std.

    Raises
    ------
    StatisticsPassFailed
        No client answered (the reasons of the first few are in the message).
    """
    fit, limit = statistics_fit(scenario, features)
    fed = scenario.federation
    nodes = FedAvg().sample(list(grid.get_node_ids()), fed.per_round, scenario.seed, 0)
    base = train_config(scenario, None, 0)
    params = np.zeros(2 * features + 1, dtype=np.float32)
    for attempt, scale in enumerate(SCALES, start=1):
        config = replace(base, extra={**base.extra, PASS_KEY: scale, LIMIT_KEY: limit})
        request = FitRequest(server_round=0, nodes=nodes, state=ServerState(params=params), config=config,
                             deadline_s=fed.deadline_s, max_update_bytes=int(fed.max_update_mb * 2**20))
        outcome = fit(grid, request, FedAvg())
        mean = _weighted_mean(outcome)
        over = mean[-1] > 1e-6 and scale != SCALES[-1]  # an honest 0 rounds to exactly 0 under secagg
        if not over:
            result = Standardization.from_vector(mean, features, scale)
            store.update_info(run_id, **{INFO_KEY: result.to_info()})
            answered = sum(c.outcome == "ok" for c in outcome.clients)
            store.log(run_id, f"federated standardisation: {features} features from {answered} "
                      f"of {len(nodes)} clients at scale {scale:g} ({attempt} pass(es)); mean "
                      f"{_span(result.mean)}, std {_span(result.std)}")
            return result
        store.log(run_id, f"statistics pass at scale {scale:g}: some client's features exceed it; asking again "
                  f"at {scale * 256:g}")
    raise AssertionError("unreachable: the last scale always returns")


def standardize_run(grid: Grid, scenario: Scenario, store: RunStore, run_id: str,
                    test: Any) -> tuple[Standardization | None, Any]:
    """The run's standardisation (``None`` unless ``[data] standardize = "federated"``) and the
    server's held-out set standardised with it."""
    if scenario.data.standardize != "federated":
        return None, test
    shape = test.x.shape[1:] if hasattr(test, "x") else getattr(load_task(scenario), "input_shape", None)
    if not shape:
        raise StatisticsPassFailed("data.standardize = \"federated\": the task does not say how many features "
                                   "its data have")
    result = federated_standardization(grid, scenario, store, run_id, int(np.prod(shape)))
    return result, standardized(test, result) if test is not None else None


def _weighted_mean(outcome: FitOutcome) -> np.ndarray:
    if outcome.aggregate is None or outcome.aggregate.count == 0:
        reasons = sorted({f"{c.outcome}: {c.reason}" for c in outcome.clients if c.reason})[:3]
        raise StatisticsPassFailed("data.standardize = \"federated\": no client answered the statistics pass"
                                   + (f" ({'; '.join(reasons)})" if reasons else ""))
    return FedAvg().finalize(outcome.aggregate, np.random.default_rng(0))


def _span(values: np.ndarray) -> str:
    return f"{float(values.min()):.4g} .. {float(values.max()):.4g}" if values.size else "-"
