"""``[dp] mechanism`` by registry: each name the scenario accepts is one mechanism, which checks its own settings."""

from __future__ import annotations

import typing

import numpy as np
import pytest

from aggregator.strategies import FedAvg
from privacy.dp.errors import DPConfigError
from privacy.dp.mechanisms import gaussian_noise
from privacy.dp.noise import MECHANISMS, DiscreteGaussian, Gaussian, mechanism_named
from privacy.dp.strategy import DPFedAvg
from scenarios.threats import DPSpec


def _dp(**kw: object) -> DPFedAvg:
    settings: dict[str, object] = {"inner": FedAvg(), "clip_norm": 1.0, "noise_multiplier": 1.0,
                                   "expected_clients": 2, "population": 4, "delta": 1e-5, **kw}
    return DPFedAvg(**settings)  # type: ignore[arg-type]


def test_every_name_the_scenario_accepts_is_one_registered_mechanism() -> None:
    accepted = typing.get_args(typing.get_type_hints(DPSpec)["mechanism"])
    assert sorted(accepted) == sorted(MECHANISMS)
    assert isinstance(MECHANISMS["gaussian"], Gaussian)
    assert isinstance(MECHANISMS["discrete_gaussian"], DiscreteGaussian)
    with pytest.raises(DPConfigError, match="mechanism.*'gaussian', 'discrete_gaussian'"):
        mechanism_named("laplace")
    with pytest.raises(DPConfigError, match="laplace"):
        _dp(mechanism="laplace")


@pytest.mark.parametrize("settings", [{"placement": "central"}, {"noise_multiplier": 0.0, "placement": "distributed"}])
def test_the_discrete_gaussian_refuses_what_it_cannot_work_with(settings: dict) -> None:
    with pytest.raises(DPConfigError, match="discrete Gaussian needs the distributed placement"):
        _dp(mechanism="discrete_gaussian", **settings)
    _dp(mechanism="gaussian", **settings)  # the continuous one takes them


def test_the_server_draws_from_the_round_generator_or_from_a_cryptographic_stream() -> None:
    # Gaussian: exactly the round generator's draws, scaled
    drawn = MECHANISMS["gaussian"].server_noise(1000, 2.0, np.random.default_rng(5))
    np.testing.assert_array_equal(drawn, gaussian_noise(1000, 2.0, np.random.default_rng(5)))
    # discrete: not from the generator (two calls with the same seed differ), std about 2 over 40,000 draws
    first = MECHANISMS["discrete_gaussian"].server_noise(40_000, 2.0, np.random.default_rng(5))
    second = MECHANISMS["discrete_gaussian"].server_noise(40_000, 2.0, np.random.default_rng(5))
    assert first.dtype == np.float32 and not np.array_equal(first, second)
    assert abs(float(first.std()) - 2.0) < 0.05 and abs(float(first.mean())) < 0.05
    # nothing to add: zeros, whichever mechanism
    assert not MECHANISMS["discrete_gaussian"].server_noise(10, 0.0, np.random.default_rng(5)).any()
    assert _dp(mechanism="discrete_gaussian", placement="distributed").discrete
    assert not _dp().discrete
