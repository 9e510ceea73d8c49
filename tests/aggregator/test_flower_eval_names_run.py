"""A Flower app's evaluate replies, whatever their metrics are called, reach the store (issue 33, item 1).

Scripted clients on a real in-process run answer evaluate as a Flower app
would: their own names (``test_loss``, ``c_index``), no accuracy. Each
client's figures are kept as its own, and the round's as a mean weighted by
each client's example count.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from tests.aggregator.test_untrusted_clients import honest, run
from tests.conftest import tiny_scenario


def survival_scores(kind: str, node: int, round_: int, params: np.ndarray) -> RecordDict:
    """Node k: a C-index of 0.5 + 0.1 k on 10 k test rows, a test_loss of 0.1 k, no accuracy."""
    if kind == "evaluate":
        return RecordDict({"metrics": MetricRecord({"num-examples": 10 * node, "test_loss": 0.1 * node,
                                                    "c_index": 0.5 + 0.1 * node})})
    return honest(node, params)


def no_loss_from_node_4(kind: str, node: int, round_: int, params: np.ndarray) -> RecordDict:
    if kind == "evaluate" and node == 4:
        return RecordDict({"metrics": MetricRecord({"num-examples": 40, "c_index": 0.9})})
    return survival_scores(kind, node, round_, params)


def test_any_named_metric_is_kept_per_client_and_as_the_rounds_weighted_mean(db_url: str) -> None:
    # Prepare
    scenario = tiny_scenario(rounds=1, evaluation={"federated": True, "server": False})

    # Execute
    store, run_id, result = run(scenario, survival_scores, db_url)

    # Assert: weights 10, 20, 30, 40 (within 3x the median 25): C-index (6 + 14 + 24 + 36) / 100,
    # loss (1 + 4 + 9 + 16) / 100
    (row,) = store.rounds(run_id)
    assert result.status == "finished" and row.answered == 4
    assert row.metrics["fed-c_index"] == pytest.approx(0.8)
    assert row.fed_loss == pytest.approx(0.3) and row.fed_accuracy is None
    records = {c.client: c for c in store.client_results(run_id)}
    assert {n: records[n].eval_loss for n in "1234"} == pytest.approx({"1": 0.1, "2": 0.2, "3": 0.3, "4": 0.4})
    assert {n: records[n].metrics["eval-c_index"] for n in "1234"} == pytest.approx(
        {"1": 0.6, "2": 0.7, "3": 0.8, "4": 0.9})


def test_a_reply_without_a_loss_counts_for_its_other_metrics_only(db_url: str) -> None:
    # Prepare: node 4 names no loss at all
    scenario = tiny_scenario(rounds=1, evaluation={"federated": True, "server": False})

    # Execute
    store, run_id, result = run(scenario, no_loss_from_node_4, db_url)

    # Assert: the loss is the mean over nodes 1-3, (1 + 4 + 9) / 60; the C-index over all four
    (row,) = store.rounds(run_id)
    assert result.status == "finished" and row.rejected == 0
    assert row.fed_loss == pytest.approx(14 / 60)
    assert row.metrics["fed-c_index"] == pytest.approx(0.8)
    assert {c.client: c.eval_loss for c in store.client_results(run_id)}["4"] is None
