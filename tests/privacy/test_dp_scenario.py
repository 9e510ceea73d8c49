"""DP-FedAvg through the real round loop: epsilon every round, the budget stop, the checkpoint."""

from __future__ import annotations

from aggregator.store import RunStore
from privacy.dp import plan_epsilon
from runtimes.simulation import simulate
from scenarios.schema import load_scenario
from tests.conftest import REPO, tiny_scenario


def test_dp_scenario_records_epsilon_every_round_and_stops_at_budget(db_url: str) -> None:
    scenario = load_scenario(REPO / "scenarios" / "dp-fedavg.toml")
    summary = simulate(scenario, db_url=db_url)
    store = RunStore(db_url)
    rounds = store.rounds(summary.run_id)
    eps = [r.epsilon for r in rounds]
    assert summary.status == "stopped_budget" and 0 < len(rounds) < scenario.rounds
    assert all(e is not None for e in eps) and eps == sorted(eps)
    # Each round's epsilon is the library's figure for that many rounds (Poisson, q = 0.3, z = 0.8).
    for t, e in enumerate(eps, start=1):
        assert abs(e - plan_epsilon(0.3, t, 0.8, 1e-5, "poisson")) < 1e-9
    # Stopped before, not after, the round that would exceed the budget.
    assert eps[-1] <= 12.0 < plan_epsilon(0.3, len(eps) + 1, 0.8, 1e-5, "poisson")
    # The accountant's history travels with the checkpoint (what resume reads back).
    from privacy.dp import DPState

    dp = DPState.from_json(store.load_state(summary.run_id).extra["dp"])
    assert dp.rounds == len(rounds) and dp.epsilon == eps[-1]


def test_dp_round_with_no_answers_is_still_accounted(db_url: str) -> None:
    scenario = tiny_scenario(rounds=1, faults={"dropouts": {"train": 0.99}},
                             dp={"enabled": True, "noise_multiplier": 1.0, "sampling": "poisson"})
    summary = simulate(scenario, db_url=db_url)
    (row,) = RunStore(db_url).rounds(summary.run_id)
    assert row.epsilon is not None and row.epsilon > 0
