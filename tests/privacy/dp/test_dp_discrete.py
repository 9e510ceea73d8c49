"""The distributed discrete Gaussian: the sampler's distribution, its accounting, and the noise on the grid.

Reference figures are computed here from the definitions (the pmf
``exp(-y^2 / 2 s^2)`` summed over the integers; Kairouz et al.'s ``tau`` and
``eps`` written out term by term), not taken from the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from privacy.dp.discrete import (
    MAX_SIGMA,
    MIN_SIGMA,
    CryptoStream,
    GridNoise,
    ddg_epsilon,
    ddg_tau,
    discrete_gaussian,
    discrete_gaussian_pmf,
)
from privacy.secagg.quantize import Quantizer

KEY = bytes(range(16))


def exact_moments(sigma: float) -> tuple[float, float]:
    """Variance and P(Y = 0) of N_Z(0, sigma^2), from the pmf summed over +-60 sigma."""
    y = np.arange(-math.ceil(60 * sigma), math.ceil(60 * sigma) + 1, dtype=np.float64)
    weights = np.exp(-(y**2) / (2 * sigma**2))
    return float(np.sum(y**2 * weights) / np.sum(weights)), float(1.0 / np.sum(weights))


@pytest.mark.parametrize("sigma", [0.6, 1.5, 4.0])
def test_small_sigma_draws_follow_the_discrete_gaussian_pmf(sigma: float) -> None:
    # Prepare: 200k draws from a fixed key; the exact pmf over the bulk, the tails lumped together
    draws = discrete_gaussian(200_000, sigma, CryptoStream(KEY))
    edge = math.ceil(3 * sigma)
    support = np.arange(-edge, edge + 1)
    observed = np.array([np.sum(draws == v) for v in support] + [np.sum(np.abs(draws) > edge)], dtype=float)
    probabilities = discrete_gaussian_pmf(support, sigma)
    expected = np.append(probabilities, 1.0 - probabilities.sum()) * draws.size

    # Execute
    _, p_value = stats.chisquare(observed, expected)

    # Assert: integers, the right shape (chi-square), the exact variance and mass at zero
    variance, p_zero = exact_moments(sigma)
    assert draws.dtype == np.int64
    assert p_value > 1e-3, (observed, expected)
    assert abs(draws.var() - variance) < 0.02 * variance
    assert abs(np.mean(draws == 0) - p_zero) < 0.005


def test_large_sigma_draws_are_integers_with_the_gaussian_moments() -> None:
    sigma = 3.0e9
    draws = discrete_gaussian(100_000, sigma, CryptoStream(KEY))
    assert draws.dtype == np.int64
    assert abs(draws.mean()) < 4 * sigma / math.sqrt(draws.size)
    assert abs(draws.std() / sigma - 1.0) < 0.01
    assert stats.kstest(draws / sigma, "norm").pvalue > 1e-3


def test_draws_at_the_largest_sigma_still_fill_every_residue() -> None:
    # Above 2^47 float64 would round the proposals to even numbers and leave the sum's low bits bare
    draws = discrete_gaussian(100_000, MAX_SIGMA, CryptoStream(KEY))
    assert abs(np.mean(draws % 2 == 0) - 0.5) < 0.01
    assert abs(np.mean(draws % 8 == 0) - 0.125) < 0.01
    with pytest.raises(ValueError, match="at most 2\\^46"):
        discrete_gaussian(10, 2 * MAX_SIGMA, CryptoStream(KEY))
    with pytest.raises(ValueError, match="raise secagg.clip_range"):
        GridNoise(noise_std=1.0, clip=1.0).sigma(2.0**52, 10)  # z C scale = 2^52 steps


def test_the_stream_is_keyed_and_fresh_keys_differ() -> None:
    a, b = CryptoStream(KEY).uniform(1000), CryptoStream(KEY).uniform(1000)
    assert np.array_equal(a, b) and a.min() > 0 and a.max() <= 1.0
    assert not np.array_equal(CryptoStream().uniform(8), CryptoStream().uniform(8))
    with pytest.raises(ValueError, match="16 bytes"):
        CryptoStream(b"short")


def test_tau_and_epsilon_follow_kairouz_et_al() -> None:
    # tau = 10 sum_{k=1}^{K-1} exp(-2 pi^2 sigma^2 k / (k+1)), here K = 3, sigma = 0.5
    tau = 10 * (math.exp(-2 * math.pi**2 * 0.25 * 1 / 2) + math.exp(-2 * math.pi**2 * 0.25 * 2 / 3))
    assert ddg_tau(0.5, 3) == pytest.approx(tau, rel=1e-12)
    # eps = min(sqrt(D2^2/(K s^2) + tau D1 / 2), D2/(sqrt(K) s) + tau sqrt(D1)) with D2 = 2, D1 = 4
    first = math.sqrt(4 / (3 * 0.25) + tau * 4 / 2)
    second = 2 / (math.sqrt(3) * 0.5) + tau * 2
    assert ddg_epsilon(2.0, 4.0, 0.5, 3) == pytest.approx(min(first, second), rel=1e-12)
    # at the sigma a client accepts, tau vanishes: the Gaussian mechanism's D2 / (sqrt(K) sigma)
    assert ddg_tau(MIN_SIGMA, 1000) == 0.0
    assert ddg_epsilon(1e6, 1e9, 2e6, 16) == pytest.approx(1e6 / (4 * 2e6), rel=1e-12)


def test_a_grid_share_is_calibrated_to_the_rounded_sensitivity_and_refuses_a_coarse_grid() -> None:
    noise = GridNoise(noise_std=0.25, clip=2.0)  # z C / sqrt(K) = 1 * 2 / sqrt(16)
    # sigma = (noise_std / C) (C scale + sqrt(d)) = 0.125 (2 * 1e6 + 100)
    assert noise.sigma(1e6, 10_000) == pytest.approx(0.125 * (2e6 + 100))
    with pytest.raises(ValueError, match="too coarse"):
        noise.sigma(10.0, 4)  # 0.125 * (20 + 2) steps


def test_noise_on_the_grid_sums_to_the_planned_variance_and_decodes_unbiased() -> None:
    # Prepare: K = 4 clients, each sending the same clipped update with its discrete share
    k, d, clip, z = 4, 20_000, 1.0, 0.8
    quantizer = Quantizer(64, clip_range=128.0, participants=k)  # 2^45 steps per unit: sigma below 2^46
    update = np.full(d, 0.005, dtype=np.float32)  # norm 0.707 < C
    noise = GridNoise(noise_std=z * clip / math.sqrt(k), clip=clip)
    rng = np.random.default_rng(0)

    # Execute: the ring sum of the four encodings, decoded
    total = np.zeros(d + 1, dtype=np.uint64)
    for _ in range(k):
        total += _encode(quantizer, update, rng, noise)
    values, weight = quantizer.decode(total)

    # Assert: the sum is 4 x 0.005 per coordinate plus noise of std z (C + sqrt(d)/scale), the weight exact
    error = values - k * 0.005
    expected_std = z * (clip + math.sqrt(d) / quantizer.scale)
    assert weight == pytest.approx(k)
    assert abs(error.mean()) < 4 * expected_std / math.sqrt(d)
    assert abs(error.std() / expected_std - 1.0) < 0.03


def test_noise_that_could_wrap_the_sum_is_refused() -> None:
    quantizer = Quantizer(64, clip_range=1.0, participants=5000)  # 5000 x (2^63 / 5000): no room left
    with pytest.raises(ValueError, match="could wrap"):
        _encode(quantizer, np.zeros(10, np.float32), np.random.default_rng(0), GridNoise(1e-5, 1.0))


def _encode(quantizer: Quantizer, update: np.ndarray, rng: np.random.Generator, noise: GridNoise) -> np.ndarray:
    out, fill = quantizer.encoder(update, 1.0, rng, noise)
    fill(0, out.shape[0])
    return out
