"""Attacks and robust aggregators through the real path: in-process grid, ClientApp mod, round loop, store."""

from __future__ import annotations

from aggregator.store import RunStore
from clients.attacks import AttackPlan
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario


def byzantine(attack: str, strategy: dict, clients: int = 5, rounds: int = 2):
    return tiny_scenario(rounds=rounds, federation={"clients": clients, "deadline_s": 300.0}, strategy=strategy,
                         faults={"byzantine": {"fraction": 0.2, "attack": attack}})


def test_centered_clipping_marks_the_clients_whose_bucket_it_clipped(db_url: str) -> None:
    # Prepare: a radius far below any update's length clips every bucket
    scenario = byzantine("signflip", {"name": "centered_clipping", "clip_radius": 1e-4, "bucket_size": 1,
                                      "momentum": 0.0})

    # Execute
    summary = simulate(scenario, db_url=db_url)

    # Assert
    results = RunStore(db_url).client_results(summary.run_id)
    assert summary.status == "finished" and len(results) == 10
    assert all(r.outcome == "ok" and r.metrics.get("clipped") == 1.0 for r in results)


def test_krum_rejects_all_but_one_update_per_round_and_says_so(db_url: str) -> None:
    # Prepare: 5 clients, f = 1 (Krum needs n > 2f + 2)
    scenario = byzantine("alie", {"name": "krum", "num_byzantine": 1})

    # Execute
    summary = simulate(scenario, db_url=db_url)

    # Assert
    results = RunStore(db_url).client_results(summary.run_id)
    for round_ in (1, 2):
        marks = [r.metrics.get("rejected") for r in results if r.round == round_]
        assert marks.count(1.0) == 4 and marks.count(None) == 1


def test_weight_inflation_reaches_the_aggregator_as_a_valid_reply(db_url: str) -> None:
    # Prepare
    scenario = byzantine("weight_inflation", {"name": "median"}, rounds=1)
    attacker = str(AttackPlan.from_scenario(scenario).attackers()[0] + 1)  # node id = partition + 1

    # Execute
    summary = simulate(scenario, db_url=db_url)

    # Assert
    results = {r.client: r for r in RunStore(db_url).client_results(summary.run_id)}
    assert results[attacker].outcome == "ok" and results[attacker].num_examples == 10**9
    assert summary.status == "finished" and summary.final_accuracy > 0.2
