"""The shipped scenarios reproduce what they promise (shortened where the paper's run is long)."""

from __future__ import annotations

import pytest

from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.schema import load_scenario
from tests.conftest import REPO

# Whole shipped scenarios run to a published figure: end to end, so in the second tier (docs/testing.md)
pytestmark = [pytest.mark.e2e, pytest.mark.heavy]

SCENARIOS = REPO / "scenarios"


def test_quickstart_reaches_90_percent(db_url: str) -> None:
    # The shipped 10 rounds give server accuracy 0.427, 0.730, 0.864, 0.908, 0.892, 0.902, 0.928, 0.938,
    # 0.944, 0.948: past 90% from round 6 on and rising. The first 7 rounds (the same rounds: the seed
    # fixes data, sampling and training) already show the claim with a 2.8-point margin, at 7/10 the cost.
    shipped = load_scenario(SCENARIOS / "quickstart.toml")
    assert shipped.rounds == 10
    summary = simulate(shipped.with_overrides(rounds=7), db_url=db_url)
    assert summary.status == "finished" and summary.rounds == 7
    assert summary.final_accuracy >= 0.90, summary


def test_fedprox_has_lower_training_loss_than_fedavg_on_synthetic(db_url: str) -> None:
    # Li et al. 2020, Fig. 1: on Synthetic(1,1) FedProx (mu=1) trains to a lower loss than
    # FedAvg. The gap is clear from round 4 (rounds 1-5: FedAvg 2.14, 2.52, 2.07, 5.44, 4.76;
    # FedProx 2.17, 2.25, 1.98, 1.96, 1.80; the full 40-round runs: 0.55 vs 1.22).
    losses = {}
    for algo in ("fedavg", "fedprox"):
        scenario = load_scenario(SCENARIOS / f"fedprox-synthetic-{algo}.toml").with_overrides(rounds=5)
        summary = simulate(scenario, db_url=db_url)
        losses[algo] = [r.train_loss for r in RunStore(db_url).rounds(summary.run_id)]
    assert losses["fedprox"][-1] < losses["fedavg"][-1]
    assert sum(losses["fedprox"][-3:]) < sum(losses["fedavg"][-3:])


def test_dropouts_scenario_completes_every_round(db_url: str) -> None:
    # The fault plan (who vanishes, who straggles) is the shipped one; what the clients train does not
    # matter to it, so logistic regression stands in for the CNN.
    shipped = load_scenario(SCENARIOS / "dropouts.toml")
    scenario = shipped.with_overrides(rounds=3, model={**shipped.to_dict()["model"], "name": "logreg"})
    summary = simulate(scenario, db_url=db_url)
    rounds = RunStore(db_url).rounds(summary.run_id)
    assert summary.status == "finished" and len(rounds) == 3
    assert all(r.dropped == 3 and r.answered == 7 for r in rounds)  # 30% of 10 sampled vanish
    assert all(r.metrics["status"] == "ok" for r in rounds)
