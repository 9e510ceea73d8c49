"""DP-FedAvg through the real round loop: epsilon every round, the budget stop, the checkpoint."""

from __future__ import annotations

import math

import pytest

from privacy.dp.accountant import plan_epsilon
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
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
    from privacy.dp.state import DPState

    dp = DPState.from_json(store.load_state(summary.run_id).wrapper_state["dp"])
    assert dp.rounds == len(rounds) and dp.epsilon == eps[-1]


def test_dp_round_with_no_answers_is_still_accounted(db_url: str) -> None:
    scenario = tiny_scenario(rounds=1, faults={"dropouts": {"train": 0.99}},
                             dp={"enabled": True, "noise_multiplier": 1.0, "sampling": "poisson"})
    summary = simulate(scenario, db_url=db_url)
    (row,) = RunStore(db_url).rounds(summary.run_id)
    assert row.epsilon is not None and row.epsilon > 0


def test_distributed_noise_without_secure_aggregation_is_refused() -> None:
    from scenarios.errors import ScenarioError

    dp = {"enabled": True, "noise_multiplier": 1.0, "placement": "distributed"}
    with pytest.raises(ScenarioError, match=r"dp\.placement = 'distributed'.*secagg\.enabled = true"):
        tiny_scenario(dp=dp)
    assert tiny_scenario(dp=dp, secagg={"enabled": True}).dp.placement == "distributed"


def test_secagg_round_with_too_few_sampled_clients_is_skipped_and_accounted(db_url: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from privacy.dp.state import DPState
    from privacy.dp.strategy import DPFedAvg

    # Prepare: distributed DP under secure aggregation, q = 4 / 8; the sample comes out as 1 client,
    # then none, then all 8 (secure aggregation needs at least 2)
    cohorts = iter([1, 0, 8])  # rounds 1, 2, 3: the sample is drawn once per round
    monkeypatch.setattr(DPFedAvg, "sample", lambda _self, ids, _k: sorted(ids)[:next(cohorts)])
    scenario = tiny_scenario(rounds=3, federation={"clients": 8, "clients_per_round": 4, "deadline_s": 60.0},
                             secagg={"enabled": True},
                             dp={"enabled": True, "noise_multiplier": 1.0, "placement": "distributed"})
    # Execute
    summary = simulate(scenario, db_url=db_url)
    # Assert: no crash; every round released and accounted at q = 0.5, z = 1
    store = RunStore(db_url)
    rows = store.rounds(summary.run_id)
    assert summary.status in ("finished", "degraded") and [r.round for r in rows] == [1, 2, 3]
    for t, row in enumerate(rows, start=1):
        assert abs(row.epsilon - plan_epsilon(0.5, t, 1.0, 1e-5, "poisson")) < 1e-9
    (lone,) = store.client_results(summary.run_id, 1)
    assert lone.outcome == "dropped" and lone.stage == "setup"
    assert [r.metrics["status"] for r in rows] == ["empty", "empty", "ok"]
    # the server saw something only in round 3: all 8 shares, so z sqrt(8 / 8) = 1, one unsampled round
    assert rows[0].metrics["server-epsilon"] == rows[1].metrics["server-epsilon"] == 0.0
    assert abs(rows[2].metrics["server-epsilon"] - plan_epsilon(1.0, 1, 1.0, 1e-5)) < 1e-9
    assert DPState.from_json(store.load_state(summary.run_id).wrapper_state["dp"]).rounds == 3


def test_central_adaptive_dp_updates_are_all_folded(db_url: str) -> None:
    # Prepare: the plain fit checks each reply against the aggregate's size (model + the count bit)
    scenario = tiny_scenario(rounds=1, dp={"enabled": True, "noise_multiplier": 0.5, "adaptive_clipping": True,
                                           "count_noise_multiplier": 2.0})
    # Execute
    summary = simulate(scenario, db_url=db_url)
    # Assert: all 4 replies folded; the clip norm moved; no server-view figure in the central placement
    store = RunStore(db_url)
    assert [c.outcome for c in store.client_results(summary.run_id, 1)] == ["ok"] * 4
    (row,) = store.rounds(summary.run_id)
    # nothing of DP's server view in the round's figures: its status, and federated evaluation's traffic
    assert row.metrics == {"status": "ok", "eval-bytes-in": row.metrics["eval-bytes-in"],
                           "eval-bytes-out": row.metrics["eval-bytes-out"]}
    assert row.metrics["eval-bytes-in"] > 0 and row.metrics["eval-bytes-out"] > 0
    from privacy.dp.state import DPState

    assert DPState.from_json(store.load_state(summary.run_id).wrapper_state["dp"]).clip != 1.0


def test_distributed_discrete_gaussian_noises_on_the_grid_and_is_accounted(db_url: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import privacy.secagg.quantize as quantize

    # Prepare: 6 clients, all sampled (fixed), z = 0.5, C = 1, a 64-bit ring; every share drawn is recorded
    draws: list[tuple[int, float]] = []
    real = quantize.discrete_gaussian
    monkeypatch.setattr(quantize, "discrete_gaussian",
                        lambda count, sigma, stream: draws.append((count, sigma)) or real(count, sigma, stream))
    dp = {"enabled": True, "noise_multiplier": 0.5, "clip_norm": 1.0, "placement": "distributed",
          "sampling": "fixed", "mechanism": "discrete_gaussian"}
    scenario = tiny_scenario(rounds=3, federation={"clients": 6, "deadline_s": 60.0},
                             secagg={"enabled": True, "bits": 64, "clip_range": 64.0}, dp=dp)

    # Execute
    summary = simulate(scenario, db_url=db_url, workers=1)  # clients in this process: recorded

    # Assert: it ran, every round was accounted as the Gaussian mechanism at z (tau is 0 at these
    # sigmas), and every model coordinate of every client got an integer share of the planned size
    rows = RunStore(db_url).rounds(summary.run_id)
    assert summary.status == "finished" and all(r.answered == 6 for r in rows)
    for t, row in enumerate(rows, start=1):
        assert abs(row.epsilon - plan_epsilon(1.0, t, 0.5, 1e-5, "fixed")) < 1e-9
    assert summary.final_accuracy is not None and 0.0 <= summary.final_accuracy <= 1.0  # noise is not seedable
    size = 64 * 10 + 10  # logreg on 8x8 digits
    assert sum(count for count, _ in draws) == 3 * 6 * size
    scale = quantize.Quantizer(64, scenario.secagg.clip_range, 6).scale
    expected = 0.5 / math.sqrt(6) * (1.0 * scale + math.sqrt(size))  # z (C scale + sqrt(d)) / sqrt(K)
    assert all(sigma == pytest.approx(expected, rel=1e-9) for _, sigma in draws)


@pytest.mark.parametrize(("dp", "secagg", "key"), [
    ({"placement": "central"}, {"enabled": True, "bits": 64}, "dp.mechanism"),
    ({"placement": "distributed"}, {"enabled": True, "bits": 32}, "secagg.bits"),
    ({"placement": "distributed", "adaptive_clipping": True}, {"enabled": True, "bits": 64}, "dp.adaptive_clipping"),
    ({"placement": "distributed"}, {"enabled": True, "bits": 64, "clip_range": 8.0}, "secagg.clip_range"),
])
def test_the_discrete_gaussian_refuses_what_it_cannot_run_on(dp: dict, secagg: dict, key: str) -> None:
    with pytest.raises(ScenarioError, match=rf"{key} = .*discrete"):
        tiny_scenario(dp={"enabled": True, "noise_multiplier": 1.0, "mechanism": "discrete_gaussian", **dp},
                      secagg=secagg)


def test_centered_clipping_under_central_dp_runs_and_clients_send_raw_deltas(db_url: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import clients.mods as mods

    # Prepare: every client's round config is recorded, as the DP mod reads it
    seen: list[dict] = []
    real = mods.ClientDPConfig

    class Recorded(real):
        @classmethod
        def from_config(cls, config):  # type: ignore[no-untyped-def]
            seen.append(dict(config.settings))
            return real.from_config(config)

    monkeypatch.setattr(mods, "ClientDPConfig", Recorded)
    scenario = tiny_scenario(rounds=2, strategy={"name": "centered_clipping", "bucket_size": 1, "clip_radius": 0.5,
                                                 "momentum": 0.5},
                             dp={"enabled": True, "noise_multiplier": 0.3, "clip_norm": 1.0, "sampling": "fixed"})

    # Execute
    summary = simulate(scenario, db_url=db_url, workers=1)  # clients in this process: recorded

    # Assert: the server clips the rule's centred term; a client clipping its raw delta first would bias
    # it, so no client was asked to; both rounds released and accounted
    rows = RunStore(db_url).rounds(summary.run_id)
    assert summary.status == "finished" and [r.answered for r in rows] == [4, 4]
    assert len(seen) == 8 and not any(k.startswith("dp-") for settings in seen for k in settings)
    for t, row in enumerate(rows, start=1):
        assert abs(row.epsilon - plan_epsilon(1.0, t, 0.3, 1e-5, "fixed")) < 1e-9
