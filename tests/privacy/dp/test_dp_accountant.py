"""The RDP accountant: figures cross-checked against dp-accounting itself."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.rdp import RdpAccountant

from privacy.dp.accountant import RoundEvent, epsilon_of, fixed_pair, noise_for_epsilon, plan_epsilon
from privacy.dp.errors import DPConfigError, DPStateError


def _library_poisson(q: float, rounds: int, z: float, delta: float) -> float:
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(("q", "rounds", "expected"), [(0.1, 100, 7.9), (0.01, 500, 1.65)])
def test_poisson_epsilon_matches_known_figures_and_library(q: float, rounds: int, expected: float) -> None:
    eps = plan_epsilon(q, rounds, 1.0, 1e-5, "poisson")
    assert eps == pytest.approx(expected, abs=0.01)  # 7.9039 and 1.6529
    assert eps == pytest.approx(_library_poisson(q, rounds, 1.0, 1e-5), rel=1e-12)


@pytest.mark.parametrize(("q", "rounds", "z", "delta"), [(0.05, 300, 1.1, 1e-6), (1.0, 10, 4.0, 1e-5),
                                                         (0.002, 2000, 0.8, 1e-7)])
def test_plan_epsilon_matches_library_to_three_digits(q: float, rounds: int, z: float, delta: float) -> None:
    ours, theirs = plan_epsilon(q, rounds, z, delta), _library_poisson(q, rounds, z, delta)
    assert float(f"{ours:.3g}") == float(f"{theirs:.3g}")


def test_fixed_size_sampling_is_replace_one_with_doubled_sensitivity() -> None:
    # Replacing one client's clipped update moves the sum by up to 2C, so the
    # multiplier the library sees is z / 2 (Wang et al. 2019, replace-one).
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
        1000, 100, dp_accounting.GaussianDpEvent(0.5)), 100)
    eps = epsilon_of([RoundEvent("fixed", 100, 1000, 1.0, 100)], 1e-5)
    assert eps == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert eps > plan_epsilon(0.1, 100, 1.0, 1e-5, "poisson")


def test_run_length_history_composes_like_one_event() -> None:
    split = [RoundEvent("poisson", 10, 100, 1.0, 40), RoundEvent("poisson", 10, 100, 1.0, 60)]
    assert epsilon_of(split, 1e-5) == pytest.approx(plan_epsilon(0.1, 100, 1.0, 1e-5), rel=1e-12)
    mixed = [RoundEvent("poisson", 10, 100, 1.0, 50), RoundEvent("poisson", 10, 100, 2.0, 50)]
    accountant = RdpAccountant()
    for z in (1.0, 2.0):
        accountant.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(z)), 50)
    assert epsilon_of(mixed, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)


def test_no_rounds_spend_nothing_and_no_noise_spends_everything() -> None:
    assert epsilon_of([], 1e-5) == 0.0
    assert plan_epsilon(0.1, 0, 1.0, 1e-5) == 0.0
    assert math.isinf(plan_epsilon(0.1, 10, 0.0, 1e-5))
    with pytest.raises(DPStateError, match="mixes"):
        epsilon_of([RoundEvent("poisson", 1, 10, 1.0), RoundEvent("fixed", 1, 10, 1.0)], 1e-5)


@pytest.mark.parametrize(("target", "q", "rounds"), [(2.0, 0.1, 100), (8.0, 0.01, 1000), (0.5, 0.001, 50)])
def test_derived_noise_reaches_target_epsilon(target: float, q: float, rounds: int) -> None:
    z = noise_for_epsilon(target, q, rounds, 1e-5)
    eps = plan_epsilon(q, rounds, z, 1e-5)
    assert eps <= target
    assert eps == pytest.approx(target, rel=2e-3)
    assert plan_epsilon(q, rounds, z * 0.99, 1e-5) > target  # no slack left on the table


def test_bad_inputs_name_the_key() -> None:
    with pytest.raises(DPConfigError, match="rate = 1.5"):
        plan_epsilon(1.5, 10, 1.0, 1e-5)
    with pytest.raises(DPConfigError, match="delta"):
        plan_epsilon(0.1, 10, 1.0, 1.0)
    with pytest.raises(DPConfigError, match="sampling"):
        plan_epsilon(0.1, 10, 1.0, 1e-5, "shuffled")  # type: ignore[arg-type]
    with pytest.raises(DPConfigError, match="noise_multiplier"):
        plan_epsilon(0.1, 10, -1.0, 1e-5)
    assert fixed_pair(0.25) == (1, 4)
