"""The statistics passes of ``[data] standardize = "federated"``, on the server (:mod:`learning.standardize`).

Before round 1 the sampled clients answer three passes (flags, means,
spread) through the run's own train workflow (plain, or secure aggregation,
where the server sees only each pass's sum), as if they were a round's
updates of a small model. Each pass weighs a client by its row count (capped
at ``federation.max_examples``, the same on both workflows). The result
travels in every later instruction. A resumed run takes the passes again (the
devices' data may have changed since); they and their outcome are in the
run's log.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
from flwr.serverapp import Grid

from aggregator.step import train_config
from aggregator.strategies import FedAvg
from aggregator.train import PlainTrain
from core.instructions import COHORT, STD_LIMIT, STD_MEAN, STD_PASS, STD_SCALES, TrainConfig
from core.status import ClientStatus
from core.strategy import ServerState, sample_clients
from core.train import TrainOutcome, TrainRequest, TrainWorkflow
from core.weighting import WeightPolicy
from learning.standardize import (
    INFO_KEY,
    SCALES,
    Standardization,
    choose_scales,
    standardized,
)
from learning.task import load_task
from privacy.secagg.train import SecAggTrain
from runstore.store import RunStore
from scenarios.schema import Scenario

__all__ = ["StatisticsPassFailed", "federated_standardization", "statistics_train", "standardize_run"]

#: The largest value a statistic takes (the pass's clip range, also under secure aggregation).
LIMIT = 1.0


class StatisticsPassFailed(RuntimeError):
    """A statistics pass failed (no client answered, or a feature too large): the run cannot standardise."""


def statistics_train(scenario: Scenario, size: int) -> TrainWorkflow:
    """Return a pass's train workflow for vectors of ``size`` values, each within :data:`LIMIT`.

    Secure aggregation when the run has it, on a 64-bit ring (the vectors are
    small, and each value is weighted by count / max_weight, which a 32-bit
    ring's steps would round visibly) with the clip range at the limit, so a
    lying client moves a sum by no more than an honest one could. Otherwise
    the plain train workflow, whose norm bound admits exactly the vectors within the limit.
    Both weigh a client by its row count, capped at ``federation.max_examples``.
    """
    cap = scenario.federation.max_examples
    if scenario.secagg.enabled:
        return SecAggTrain(replace(scenario.secagg, bits=64, clip_range=LIMIT, max_weight=float(cap)))
    return PlainTrain(WeightPolicy("capped", max_examples=cap),
                    max_update_ratio=LIMIT * math.sqrt(size) * 1.001)  # 1.001: float32 rounding


def federated_standardization(grid: Grid, scenario: Scenario, store: RunStore, run_id: str,
                              features: int) -> Standardization:
    """Run the three passes over the run's first sample of clients; log them; return the mean and std.

    Raises
    ------
    StatisticsPassFailed
        A pass no client answered (the reasons of the first few are in the message), or a
        feature beyond the largest scale.
    """
    nodes = sample_clients(FedAvg(), list(grid.get_node_ids()), scenario.federation.per_round, scenario.seed, 0)
    base = train_config(scenario, None, 0)
    flags, answered = _pass(grid, scenario, nodes, base.with_settings({STD_PASS: "flags"}),
                            features * len(SCALES))
    try:
        scales = choose_scales(flags, features)
    except ValueError as exc:
        raise StatisticsPassFailed(f"data.standardize = \"federated\": {exc}") from None
    given = base.with_settings({STD_SCALES: [float(s) for s in scales]})
    means, _ = _pass(grid, scenario, nodes, given.with_settings({STD_PASS: "means"}), features)
    centre = means.astype(np.float64) * scales
    spread, _ = _pass(grid, scenario, nodes, given.with_settings(
        {STD_PASS: "spread", STD_MEAN: [float(m) for m in centre]}), features)
    result = Standardization.from_passes(means, spread, scales)
    store.update_info(run_id, **{INFO_KEY: result.to_info()})
    store.log(run_id, f"federated standardisation: {features} features from {answered} of {len(nodes)} clients "
              f"(scales {_span(scales)}); mean {_span(result.mean)}, std {_span(result.std)}; "
              f"{int((result.std == 1.0).sum())} constant")
    return result


def _pass(grid: Grid, scenario: Scenario, nodes: list[int], config: TrainConfig,
          size: int) -> tuple[np.ndarray, int]:
    """One pass: the clients' weighted mean vector, and how many clients it holds."""
    fed = scenario.federation
    request = TrainRequest(server_round=0, nodes=nodes, state=ServerState(params=np.zeros(size, np.float32)),
                         config=config.with_settings({STD_LIMIT: LIMIT, COHORT: len(nodes)}),
                         deadline_s=fed.deadline_s, max_update_bytes=int(fed.max_update_mb * 2**20))
    outcome = statistics_train(scenario, size)(grid, request, FedAvg())
    answered = sum(c.outcome == ClientStatus.OK for c in outcome.clients)
    return _weighted_mean(outcome, str(config.get(STD_PASS))), answered


def standardize_run(grid: Grid, scenario: Scenario, store: RunStore, run_id: str,
                    test: Any) -> tuple[Standardization | None, Any]:
    """Return the run's standardisation and the server's held-out set standardised with it.

    The standardisation is ``None`` unless ``[data] standardize = "federated"``.
    """
    if scenario.data.standardize != "federated":
        return None, test
    shape = test.x.shape[1:] if hasattr(test, "x") else getattr(load_task(scenario), "input_shape", None)
    if not shape:
        raise StatisticsPassFailed("data.standardize = \"federated\": the task does not say how many features "
                                   "its data have")
    result = federated_standardization(grid, scenario, store, run_id, int(np.prod(shape)))
    return result, standardized(test, result) if test is not None else None


def _weighted_mean(outcome: TrainOutcome[Any], kind: str) -> np.ndarray:
    if outcome.aggregate is None or outcome.aggregate.count == 0:
        reasons = sorted({f"{c.outcome}: {c.reason}" for c in outcome.clients if c.reason})[:3]
        raise StatisticsPassFailed(f"data.standardize = \"federated\": no client answered the {kind} statistics "
                                   "pass" + (f" ({'; '.join(reasons)})" if reasons else ""))
    return FedAvg().finalize(outcome.aggregate, np.random.default_rng(0))


def _span(values: np.ndarray) -> str:
    return f"{float(values.min()):.4g} .. {float(values.max()):.4g}" if values.size else "-"
