"""The round loop over the in-process runtime, checked against independent computations."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.strategies import FedAvg
from core.instructions import client_seed
from core.strategy import sample_clients
from learning.federation import build_federation
from learning.models import build_model, get_flat, set_flat
from learning.training import train
from runstore.store import RunStore
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario


def final_params(db_url: str, run_id: str) -> np.ndarray:
    return RunStore(db_url).load_state(run_id).params


def fedavg_by_hand(scenario, nodes: list[int], round_: int, params: np.ndarray) -> np.ndarray:
    """One FedAvg round computed without the platform: train each client, weight by examples."""
    fed = build_federation(scenario.data, scenario.federation.clients, scenario.seed)
    total, weight = np.zeros_like(params, dtype=np.float64), 0
    for node in nodes:
        model = build_model(scenario.model.name, fed.input_shape, fed.num_classes, seed=scenario.seed)
        set_flat(model, params)
        data = fed.clients[node - 1].train
        t = scenario.training
        train(model, data, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr,
              seed=client_seed(scenario.seed, round_, node))
        total += len(data) * (get_flat(model).astype(np.float64) - params)
        weight += len(data)
    return (params + total / weight).astype(np.float32)


def initial_params(scenario) -> np.ndarray:
    fed = build_federation(scenario.data, scenario.federation.clients, scenario.seed)
    return get_flat(build_model(scenario.model.name, fed.input_shape, fed.num_classes, seed=scenario.seed))


def test_one_round_equals_fedavg_computed_by_hand(db_url: str) -> None:
    scenario = tiny_scenario(rounds=1)
    summary = simulate(scenario, db_url=db_url)
    expected = fedavg_by_hand(scenario, [1, 2, 3, 4], 1, initial_params(scenario))
    np.testing.assert_allclose(final_params(db_url, summary.run_id), expected, rtol=1e-5, atol=1e-6)
    rounds = RunStore(db_url).rounds(summary.run_id)
    assert [r.answered for r in rounds] == [4]
    assert summary.status == "finished" and summary.final_accuracy > 0.5


def test_runs_are_deterministic_for_a_seed(db_url: str) -> None:
    scenario = tiny_scenario()
    a = simulate(scenario, db_url=db_url)
    b = simulate(scenario, db_url=db_url)
    np.testing.assert_array_equal(final_params(db_url, a.run_id), final_params(db_url, b.run_id))


def test_dropouts_are_recorded_and_round_completes_without_waiting(db_url: str) -> None:
    scenario = tiny_scenario(federation={"clients": 6, "deadline_s": 60.0}, faults={"dropouts": {"train": 0.5}})
    summary = simulate(scenario, db_url=db_url)
    store = RunStore(db_url)
    rounds = store.rounds(summary.run_id)
    assert [(r.answered, r.dropped) for r in rounds] == [(3, 3), (3, 3)]
    assert all(r.duration_s < 30 for r in rounds)  # closed early, not at the 60 s deadline
    dropped = [c for c in store.client_results(summary.run_id) if c.outcome == "dropped"]
    assert len(dropped) == 6 and all(c.stage == "train" for c in dropped)


@pytest.mark.parametrize("kind", ["nan", "wrong_shape", "oversized", "garbage"])
def test_byzantine_updates_are_rejected_with_a_reason(db_url: str, kind: str) -> None:
    scenario = tiny_scenario(rounds=1, faults={"byzantine": 0.5, "byzantine_kind": kind})
    summary = simulate(scenario, db_url=db_url)
    store = RunStore(db_url)
    results = store.client_results(summary.run_id)
    rejected = [c for c in results if c.outcome == "rejected"]
    honest = sorted(int(c.client) for c in results if c.outcome == "ok")
    assert rejected and honest and len(rejected) + len(honest) == 4
    assert all(c.reason for c in rejected)
    # The global model is FedAvg over the honest clients only.
    expected = fedavg_by_hand(scenario, honest, 1, initial_params(scenario))
    np.testing.assert_allclose(final_params(db_url, summary.run_id), expected, rtol=1e-5, atol=1e-6)


def test_too_few_updates_skips_the_round_and_keeps_the_model(db_url: str) -> None:
    scenario = tiny_scenario(rounds=1, federation={"min_clients": 3}, faults={"dropouts": {"train": 0.5}})
    summary = simulate(scenario, db_url=db_url)
    store = RunStore(db_url)
    np.testing.assert_array_equal(final_params(db_url, summary.run_id), initial_params(scenario))
    assert store.rounds(summary.run_id)[0].metrics["status"] == "skipped"
    assert any("fewer than min_clients = 3" in e.message for e in store.events(summary.run_id))


def test_sampling_is_a_pure_function_of_seed_and_round() -> None:
    nodes = list(range(1, 21))
    assert sample_clients(FedAvg(), nodes, 5, 1, 3) == sample_clients(FedAvg(), list(reversed(nodes)), 5, 1, 3)
    assert sample_clients(FedAvg(), nodes, 5, 1, 3) != sample_clients(FedAvg(), nodes, 5, 1, 4)
    assert len(set(sample_clients(FedAvg(), nodes, 5, 1, 3))) == 5
