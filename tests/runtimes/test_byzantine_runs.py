"""Attacks and robust aggregators through the real path: in-process grid, ClientApp mod, round loop, store."""

from __future__ import annotations

from clients.attacks import AttackPlan
from learning.federation import cached_federation
from runstore.store import RunStore
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


def test_iid_attacker_data_reaches_the_attackers_clientapp(db_url: str) -> None:
    # Prepare: digits' pool split over the 4 honest clients by Dirichlet(0.5) (their sizes differ); the attacker
    # holds an IID copy as large as their mean share
    scenario = tiny_scenario(rounds=1, data={"partition": "dirichlet", "alpha": 0.5}, strategy={"name": "median"},
                             federation={"clients": 5, "deadline_s": 300.0},
                             faults={"byzantine": {"fraction": 0.2, "attack": "signflip", "data": "iid"}})
    (attacker,) = AttackPlan.from_scenario(scenario).attackers()
    fed = cached_federation(scenario)
    honest = [c for i, c in enumerate(fed.clients) if i != attacker]
    pool = {row.tobytes() for c in honest for d in (c.train, c.test) for row in d.x}
    share = round((1797 - 359) / 4)  # digits less the server's 20% of each class, over 4

    # Execute
    summary = simulate(scenario, db_url=db_url)

    # Assert: the attacker trained on the copy's train split (its share less 10% for its test split), rows the
    # honest clients hold; every honest client reported its own count, none of them the attacker's
    results = {int(r.client) - 1: r.num_examples for r in RunStore(db_url).client_results(summary.run_id)}
    copy = fed.clients[attacker].train
    assert results[attacker] == len(copy) == share - round(0.1 * share)
    assert {row.tobytes() for row in copy.x} <= pool
    assert sorted(n for i, n in results.items() if i != attacker) == sorted(len(c.train) for c in honest)
    assert results[attacker] not in {len(c.train) for c in honest}
