"""DPFedAvg: clipping at the server, noise, fixed denominator, accountant and budget."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from aggregator.strategies import FedAvg, FedAvgM, ServerState
from core.errors import UpdateRejected
from core.strategy import describe
from privacy.dp.accountant import plan_epsilon
from privacy.dp.adaptive import AdaptiveClipConfig
from privacy.dp.build import make_dp_strategy
from privacy.dp.errors import DPConfigError, DPStateError
from privacy.dp.mechanisms import client_payload
from privacy.dp.strategy import DPFedAvg
from scenarios.threats import DPSpec


def make_dp(**overrides: object) -> DPFedAvg:
    """A small central DP-FedAvg over FedAvg; keyword arguments override fields."""
    settings: dict[str, object] = dict(inner=FedAvg(), clip_norm=1.0, noise_multiplier=1.0, expected_clients=10,
                                       population=100, delta=1e-5, sampling="poisson", placement="central")
    settings.update(overrides)
    return DPFedAvg(**settings)  # type: ignore[arg-type]


def adaptive(**overrides: object) -> AdaptiveClipConfig:
    return AdaptiveClipConfig(**overrides)  # type: ignore[arg-type]


def _round(dp: DPFedAvg, state: ServerState, updates: list[np.ndarray], rng: np.random.Generator) -> ServerState:
    """One round as the loop drives it, with payloads built by the client helper."""
    bound = dp.for_round(state)
    config = bound.client_dp_config()
    agg = bound.new_aggregate(state.params.size)
    for u in updates:
        agg = bound.accumulate(agg, client_payload(u, config, rng), 7)
    return bound.apply(state, bound.finalize(agg, rng))


def test_server_clips_each_update_and_divides_by_expected_clients(rng: np.random.Generator) -> None:
    # Prepare: z = 0 isolates clipping; 3 of m = 4 expected clients answer.
    dp = make_dp(noise_multiplier=0.0, expected_clients=4, population=40, clip_norm=1.0).for_round(
        make_dp().fresh_state(np.zeros(2, np.float32)))
    agg = dp.new_aggregate(2)
    for u in ([3.0, 4.0], [0.3, 0.4], [0.0, -10.0]):  # norms 5, 0.5, 10
        agg = dp.accumulate(agg, np.array(u, np.float32), 1000)
    # Execute
    mean = dp.finalize(agg, rng)
    # Assert: (0.6, 0.8) + (0.3, 0.4) + (0, -1), over the fixed denominator 4; then the 3 contributors
    np.testing.assert_allclose(mean, [0.9 / 4, 0.2 / 4, 3.0], rtol=1e-5)
    assert agg.count == 3


def test_central_noise_on_the_sum_has_std_z_times_c(rng: np.random.Generator) -> None:
    # 100k coordinates of zero updates: the mean holds only noise / m;
    # the 3% tolerance is > 13 standard errors of a 100k-sample std.
    dp = make_dp(noise_multiplier=1.2, clip_norm=0.5, expected_clients=8).for_round(
        make_dp().fresh_state(np.zeros(1, np.float32)))
    agg = dp.new_aggregate(100_000)
    for _ in range(3):
        agg = dp.accumulate(agg, np.zeros(100_000, np.float32), 1)
    noise_on_sum = dp.finalize(agg, rng)[:-1] * 8  # the last value is the accounting slot
    assert float(noise_on_sum.std()) == pytest.approx(1.2 * 0.5, rel=0.03)


def test_distributed_shares_add_up_to_the_central_noise(rng: np.random.Generator) -> None:
    # m = 25 clients each add std zC/sqrt(m); the server adds nothing; the
    # summed noise must have the central std zC (3% on 100k coordinates).
    z, clip, m, size = 0.9, 2.0, 25, 100_000
    dist = make_dp(noise_multiplier=z, clip_norm=clip, expected_clients=m, population=1000,
                   placement="distributed")
    state = dist.fresh_state(np.zeros(size, np.float32))
    bound = dist.for_round(state)
    config = bound.client_dp_config()
    assert config is not None and config.noise_std == pytest.approx(z * clip / 5)
    agg = bound.new_aggregate(size)
    for _ in range(m):
        agg = bound.accumulate(agg, client_payload(np.zeros(size, np.float32), config, rng), 1)
    distributed_sum = bound.finalize(agg, rng)[:-1] * m
    central = make_dp(noise_multiplier=z, clip_norm=clip, expected_clients=m, population=1000).for_round(state)
    central_sum = central.finalize(central.new_aggregate(size), rng)[:-1] * m
    assert float(distributed_sum.std()) == pytest.approx(z * clip, rel=0.03)
    assert float(distributed_sum.std()) == pytest.approx(float(central_sum.std()), rel=0.03)


def test_distributed_tops_up_noise_when_clients_drop(rng: np.random.Generator) -> None:
    # 16 of m = 64 answer: they carry 1/4 of the variance, the server adds 3/4.
    dp = make_dp(noise_multiplier=1.0, clip_norm=1.0, expected_clients=64, population=640,
                 placement="distributed").for_round(make_dp().fresh_state(np.zeros(1, np.float32)))
    config = dp.client_dp_config()
    agg = dp.new_aggregate(100_000)
    for _ in range(16):
        agg = dp.accumulate(agg, client_payload(np.zeros(100_000, np.float32), config, rng), 1)
    assert float((dp.finalize(agg, rng)[:-1] * 64).std()) == pytest.approx(1.0, rel=0.03)


def test_distributed_server_does_not_clip(rng: np.random.Generator) -> None:
    dp = make_dp(noise_multiplier=0.0, expected_clients=2, placement="distributed").for_round(
        make_dp().fresh_state(np.zeros(2, np.float32)))
    agg = dp.accumulate(dp.new_aggregate(2), np.array([30.0, 40.0], np.float32), 1)
    np.testing.assert_allclose(dp.finalize(agg, rng), [15.0, 20.0, 1.0])


def test_apply_delegates_to_inner_and_records_epsilon(rng: np.random.Generator) -> None:
    dp = make_dp(inner=FedAvgM(server_lr=1.0, momentum=0.9), noise_multiplier=0.0)
    state = dp.fresh_state(np.zeros(2, np.float32))
    state = _round(dp, state, [np.array([0.5, 0.0], np.float32)] * 10, rng)
    np.testing.assert_allclose(state.params, [0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(state.slots["momentum"], [0.5, 0.0], rtol=1e-6)  # FedAvgM's own state
    assert state.round == 1 and math.isinf(dp.epsilon(state))
    noisy = make_dp()
    s = _round(noisy, noisy.fresh_state(np.zeros(2, np.float32)), [np.zeros(2, np.float32)], rng)
    assert noisy.epsilon(s) == pytest.approx(plan_epsilon(0.1, 1, 1.0, 1e-5), rel=1e-12)
    assert s.wrapper_state["dp"]["epsilon"] == noisy.epsilon(s)


def test_budget_stops_before_the_round_that_would_exceed_it(rng: np.random.Generator) -> None:
    # Prepare: q = 0.1, z = 1: epsilon after r rounds is plan_epsilon(0.1, r, 1, 1e-5).
    target = 3.0
    last_ok = max(r for r in range(1, 60) if plan_epsilon(0.1, r, 1.0, 1e-5) <= target)
    dp = make_dp(target_epsilon=target)
    state = dp.fresh_state(np.zeros(3, np.float32))
    # Execute: the loop's contract, check before every round
    while not dp.would_exceed_budget(state):
        state = _round(dp, state, [np.ones(3, np.float32)], rng)
    # Assert: it ran exactly the rounds that fit, and never went over
    assert state.round == last_ok
    assert dp.epsilon(state) <= target
    assert plan_epsilon(0.1, last_ok + 1, 1.0, 1e-5) > target
    assert not make_dp().would_exceed_budget(state)  # no target, no stop


def test_state_json_roundtrip_restores_accountant_exactly(rng: np.random.Generator) -> None:
    dp = make_dp(adaptive=adaptive(count_noise_std=2.0), target_epsilon=50.0, expected_clients=10)
    state = dp.fresh_state(np.zeros(4, np.float32))
    for _ in range(5):
        state = _round(dp, state, [rng.standard_normal(4).astype(np.float32) for _ in range(10)], rng)
    # Execute: what a checkpoint does with the wrapper state
    restored = ServerState(params=state.params.copy(), slots=dict(state.slots), round=state.round,
                           wrapper_state=json.loads(json.dumps(state.wrapper_state)))
    # Assert
    assert dp.dp_state(restored) == dp.dp_state(state)
    assert dp.epsilon(restored) == dp.epsilon(state)
    assert dp.would_exceed_budget(restored) == dp.would_exceed_budget(state)
    assert dp.for_round(restored).clip_norm == dp.for_round(state).clip_norm != 1.0


def test_state_without_dp_history_past_round_zero_is_refused() -> None:
    dp = make_dp()
    with pytest.raises(DPStateError, match="no DP state"):
        dp.epsilon(ServerState(params=np.zeros(2, np.float32), round=3))
    with pytest.raises(DPStateError, match="unknown layout"):
        dp.epsilon(ServerState(params=np.zeros(2, np.float32), wrapper_state={"dp": {"version": 99}}))


def test_adaptive_clip_moves_to_the_target_quantile(rng: np.random.Generator) -> None:
    # Norms ~ Uniform(0, 2): the median is 1 and the 0.8-quantile is 1.6.
    for gamma, quantile in ((0.5, 1.0), (0.8, 1.6)):
        dp = make_dp(noise_multiplier=1.0, expected_clients=100, population=10_000, clip_norm=0.1,
                     adaptive=adaptive(target_quantile=gamma, learning_rate=0.2))
        state = dp.fresh_state(np.zeros(8, np.float32))
        clips = []
        for _ in range(150):
            directions = rng.standard_normal((100, 8))
            norms = rng.uniform(0.0, 2.0, (100, 1))
            updates = (directions / np.linalg.norm(directions, axis=1, keepdims=True) * norms).astype(np.float32)
            state = _round(dp, state, list(updates), rng)
            clips.append(dp.dp_state(state).clip)
        assert np.mean(clips[-50:]) == pytest.approx(quantile, rel=0.1)


def test_adaptive_raises_update_noise_and_accounts_effective_z() -> None:
    dp = make_dp(noise_multiplier=1.0, expected_clients=100, adaptive=adaptive())  # sigma_b = 100 / 20
    assert dp.count_noise_std == 5.0
    assert dp.update_noise_multiplier == pytest.approx((1.0 - 1.0 / 100) ** -0.5)
    with pytest.raises(DPConfigError, match="count_noise_multiplier"):
        make_dp(noise_multiplier=4.0, adaptive=adaptive(count_noise_std=1.0))


def test_adaptive_needs_the_round_binding(rng: np.random.Generator) -> None:
    dp = make_dp(adaptive=adaptive(count_noise_std=2.0))
    with pytest.raises(DPStateError, match="for_round"):
        dp.client_dp_config()
    state = dp.fresh_state(np.zeros(2, np.float32))
    state = _round(dp, state, [np.ones(2, np.float32)], rng)
    stale = dp.for_round(dp.fresh_state(np.zeros(2, np.float32)))  # bound to round 0's clip
    with pytest.raises(DPStateError, match="bound clip norm"):
        stale.apply(state, np.zeros(3, np.float32))


def test_make_dp_strategy_from_scenario_spec() -> None:
    spec = DPSpec(enabled=True, target_epsilon=4.0, sampling="poisson", delta=1e-6, clip_norm=0.5,
                  adaptive_clipping=True, target_quantile=0.7, clip_lr=0.1)
    dp = make_dp_strategy(FedAvg(), spec, clients_per_round=50, population=1000, rounds=200)
    assert plan_epsilon(0.05, 200, dp.noise_multiplier, 1e-6) == pytest.approx(4.0, rel=2e-3)
    assert dp.adaptive is not None and dp.adaptive.target_quantile == 0.7 and dp.clip_norm == 0.5
    assert dp.target_epsilon == 4.0
    assert describe(dp)["inner"] == {"name": "fedavg", "server_lr": 1.0}
    with pytest.raises(DPConfigError, match="enabled"):
        make_dp_strategy(FedAvg(), DPSpec(), clients_per_round=5, population=10, rounds=1)


@pytest.mark.parametrize(("field", "value"), [("clip_norm", 0.0), ("expected_clients", 0),
                                              ("placement", "edge"), ("delta", 2.0), ("sampling", "x")])
def test_bad_settings_name_the_key(field: str, value: object) -> None:
    with pytest.raises(DPConfigError, match=field if field != "expected_clients" else "expected_clients"):
        make_dp(**{field: value})


def test_accumulate_rejects_wrong_sizes_and_bad_values() -> None:
    dp = make_dp().for_round(make_dp().fresh_state(np.zeros(3, np.float32)))
    with pytest.raises(UpdateRejected, match="shape"):
        dp.accumulate(dp.new_aggregate(3), np.zeros(4, np.float32), 1)
    with pytest.raises(UpdateRejected, match="NaN"):
        dp.accumulate(dp.new_aggregate(3), np.array([0.0, np.nan, 1.0], np.float32), 1)


def test_central_server_clamps_a_lying_count_bit() -> None:
    dp = make_dp(noise_multiplier=0.0, expected_clients=2, adaptive=adaptive(count_noise_std=1.0))
    bound = dp.for_round(dp.fresh_state(np.zeros(2, np.float32)))
    agg = bound.accumulate(bound.new_aggregate(2), np.array([0.0, 0.0, 1e6], np.float32), 1)
    assert agg.size == 3 and agg.total[-1] == 0.5
