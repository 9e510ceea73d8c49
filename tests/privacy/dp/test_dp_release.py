"""DP accounting that matches what is released: noise shares sized by the realised cohort,
the server-view epsilon from the real contributors, and the bounded count bit of a secure sum."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from aggregator.strategies import FedAvg, ServerState
from core import aggregate
from privacy.dp.accountant import plan_epsilon
from privacy.dp.adaptive import AdaptiveClipConfig
from privacy.dp.errors import DPConfigError
from privacy.dp.mechanisms import client_payload
from privacy.dp.strategy import DPFedAvg

Z, CLIP, M, N = 0.8, 1.0, 30, 100  # the settings: z = 0.8, m = 30 expected of 100 (q = 0.3)


def distributed(**overrides: object) -> DPFedAvg:
    settings: dict[str, object] = dict(inner=FedAvg(), clip_norm=CLIP, noise_multiplier=Z, expected_clients=M,
                                       population=N, delta=1e-5, sampling="poisson", placement="distributed")
    settings.update(overrides)
    return DPFedAvg(**settings)  # type: ignore[arg-type]


def _round(dp: DPFedAvg, state: ServerState, sampled: int, contributors: int,
           rng: np.random.Generator) -> tuple[ServerState, np.ndarray]:
    """One round as the loop drives it: bind, size the shares by ``sampled``, fold ``contributors`` payloads
    of zero updates (what is left is noise), finalize and apply. Returns the state and the released sum."""
    bound = dp.for_round(state).with_cohort(sampled)
    config = bound.client_dp_config()
    agg = bound.new_aggregate(state.params.size)
    for _ in range(contributors):
        agg = bound.accumulate(agg, client_payload(np.zeros(state.params.size, np.float32), config, rng), 1)
    mean = bound.finalize(agg, rng)
    return bound.apply(state, mean), mean[:state.params.size] * M


def test_each_share_follows_the_sampled_count() -> None:
    state = distributed().fresh_state(np.zeros(1, np.float32))
    for sampled, std in ((36, 0.8 / 6), (25, 0.8 / 5), (1, 0.8)):  # z C / sqrt(K), by hand
        config = distributed().for_round(state).with_cohort(sampled).client_dp_config()
        assert config.noise_std == pytest.approx(std, rel=1e-12)
    with pytest.raises(DPConfigError, match="sampled"):
        distributed().with_cohort(-1)


@pytest.mark.parametrize(("sampled", "contributors"), [(20, 20), (30, 30), (33, 33), (40, 40), (36, 27), (31, 0)])
def test_released_noise_does_not_depend_on_the_cohort(sampled: int, contributors: int,
                                                      rng: np.random.Generator) -> None:
    # Prepare: 40,000 coordinates of zero updates, so the released sum is pure noise. By hand:
    # c shares of variance (z C)^2 / K plus the server's (1 - c / K) (z C)^2 = (z C)^2 = 0.64, std 0.8,
    # for every K and c.
    dp = distributed()
    state = dp.fresh_state(np.zeros(40_000, np.float32))
    # Execute
    _, released = _round(dp, state, sampled, contributors, rng)
    # Assert: 3% is 8 standard errors of a 40k-sample std (1 / sqrt(80,000) = 0.35%)
    assert float(released.std()) == pytest.approx(Z * CLIP, rel=0.03)
    if sampled == 40:  # the old shares z C / sqrt(m) would have shown this K: sqrt(40 / 30) 0.8 = 0.924
        assert float(released.std()) < math.sqrt(40 / M) * Z * CLIP - 0.1


def test_server_view_epsilon_is_accounted_from_real_contributors(rng: np.random.Generator) -> None:
    # Prepare: four rounds of (sampled K, contributors c); the server saw noise z sqrt(c / K) each round,
    # unsampled (it knows whom it asked); a round nobody contributed to showed it nothing.
    rounds = [(30, 30), (36, 27), (25, 0), (30, 24)]
    dp = distributed()
    state = dp.fresh_state(np.zeros(4, np.float32))
    # Execute
    per_round = []
    for sampled, contributors in rounds:
        state, _ = _round(dp, state, sampled, contributors, rng)
        per_round.append(dp.round_metrics(state).get("server-epsilon"))
    # Assert: the library's plain Gaussian mechanism, composed by hand: 0.8, 0.8 sqrt(27/36), -, 0.8 sqrt(24/30)
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    expected = []
    for z in (0.8, 0.8 * math.sqrt(0.75), None, 0.8 * math.sqrt(0.8)):
        if z is not None:
            accountant.compose(dp_accounting.GaussianDpEvent(z))
        expected.append(accountant.get_epsilon(1e-5))
    assert per_round == pytest.approx(expected, rel=1e-9)
    assert dp.server_view_epsilon(state) == pytest.approx(expected[-1], rel=1e-9)
    # what anyone who sees the models gets does not depend on K or c: four planned rounds at q = 0.3
    assert dp.epsilon(state) == pytest.approx(plan_epsilon(0.3, 4, Z, 1e-5), rel=1e-12)
    # fewer contributors, less noise, more epsilon against the server than the planned z would say
    assert per_round[-1] > plan_epsilon(1.0, 3, Z, 1e-5)


def test_central_server_view_is_unbounded_and_not_recorded(rng: np.random.Generator) -> None:
    dp = distributed(placement="central")
    state, _ = _round(dp, dp.fresh_state(np.zeros(3, np.float32)), 30, 30, rng)
    assert math.isinf(dp.server_view_epsilon(state)) and dp.round_metrics(state) == {}


def test_server_view_history_survives_a_checkpoint(rng: np.random.Generator) -> None:
    import json

    dp = distributed()
    state, _ = _round(dp, dp.fresh_state(np.zeros(3, np.float32)), 36, 27, rng)
    restored = ServerState(params=state.params, round=state.round,
                           wrapper_state=json.loads(json.dumps(state.wrapper_state)))
    assert dp.server_view_epsilon(restored) == dp.server_view_epsilon(state) > 0


def _secure_sum(values: list[float], count: int) -> aggregate.MeanState:
    return aggregate.MeanState(total=np.array(values, np.float32), weight=float(count), count=count)


def test_secure_sum_count_bit_is_bounded_to_what_honest_clients_send() -> None:
    # Central: 4 clients' bits are +-1/2 each, so the summed bit lies in [-2, 2]. A sum of 7.5
    # (a liar sending 8 where 1/2 belongs... or anything) is clamped to 2; an honest 1.0 passes as is.
    central = distributed(placement="central", noise_multiplier=0.0, expected_clients=4, population=40,
                          adaptive=AdaptiveClipConfig(count_noise_std=1.0))
    bound = central.for_round(central.fresh_state(np.zeros(2, np.float32))).with_cohort(4)
    for summed, kept in ((7.5, 2.0), (-9.0, -2.0), (1.0, 1.0)):
        agg = bound.fold_sum(bound.new_aggregate(2), _secure_sum([0.1, 0.2, summed], 4))
        assert float(agg.total[2]) == kept and agg.count == 4 and agg.size == 3
    # Distributed: each of K = 4 shares has std sigma_b / sqrt(K) = 2 / 2 = 1; the four summed have std 2,
    # so the honest range is [-2, 2] widened by 6 * 2 = 12: +-14.
    dist = distributed(noise_multiplier=0.5, expected_clients=4, population=40,
                       adaptive=AdaptiveClipConfig(count_noise_std=2.0))
    bound = dist.for_round(dist.fresh_state(np.zeros(2, np.float32))).with_cohort(4)
    for summed, kept in ((100.0, 14.0), (-100.0, -14.0), (5.5, 5.5)):
        agg = bound.fold_sum(bound.new_aggregate(2), _secure_sum([0.0, 0.0, summed], 4))
        assert float(agg.total[2]) == pytest.approx(kept)


def test_released_fraction_under_the_clip_norm_stays_in_unit_interval(rng: np.random.Generator) -> None:
    dp = distributed(placement="central", noise_multiplier=0.0, expected_clients=2, population=20,
                     adaptive=AdaptiveClipConfig(count_noise_std=1e-9))
    bound = dp.for_round(dp.fresh_state(np.zeros(1, np.float32))).with_cohort(2)
    agg = bound.fold_sum(bound.new_aggregate(1), _secure_sum([0.0, 1.0], 2))  # both under C: b_bar = 1
    assert float(bound.finalize(agg, rng)[1]) == pytest.approx(1.0)
