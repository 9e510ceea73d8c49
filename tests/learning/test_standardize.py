"""Federated standardisation's arithmetic: pooled means and stds from count-weighted pass vectors, against numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.instructions import STD_MEAN, TrainConfig
from learning.datasets import ArrayDataset, ClientData
from learning.standardize import (
    SCALES,
    Standardization,
    StandardizeInputs,
    choose_scales,
    standardized,
    statistics_vector,
)

BASE = TrainConfig(round=1, epochs=1, batch_size=1, lr=0.1, seed=0)

def clients(seed: int = 0) -> list[np.ndarray]:
    """Three devices' raw rows in mixed units: pixels 0-255 (shifted), incomes near 5,000-14,000, ages
    near 40 with a spread of 0.3, and a column that is 7 everywhere; of different sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for n, shift in ((40, 0.0), (75, 30.0), (130, 90.0)):
        pixels = rng.integers(0, 256, size=(n, 2)) + shift
        income = rng.normal(5_000 + 100 * shift, 800, size=(n, 1))
        age = rng.normal(40 + shift / 90, 0.3, size=(n, 1))
        out.append(np.hstack([pixels, income, age, np.full((n, 1), 7.0)]).astype(np.float32))
    return out


def pooled_pass(rows: list[np.ndarray], kind: str, **given: object) -> np.ndarray:
    """The count-weighted mean of every client's vector: what the server's fold gives."""
    counts = np.array([len(x) for x in rows], dtype=np.float64)
    vectors = np.stack([statistics_vector(x, kind, 1.0, **given) for x in rows]).astype(np.float64)
    return (vectors * counts[:, None]).sum(axis=0) / counts.sum()


def test_three_passes_give_the_pooled_mean_and_std_of_every_feature_in_its_own_units() -> None:
    rows = clients()
    scales = choose_scales(pooled_pass(rows, "flags"), 5)
    # each feature's smallest scale that no device's mean or rms exceeds
    assert scales.tolist() == [256.0, 256.0, 65536.0, 256.0, 256.0]
    means = pooled_pass(rows, "means", scales=scales)
    spread = pooled_pass(rows, "spread", scales=scales, mean=means * scales)
    result = Standardization.from_passes(means, spread, scales)
    pooled = np.concatenate(rows).astype(np.float64)
    np.testing.assert_allclose(result.mean, pooled.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(result.std[:4], pooled.std(axis=0)[:4], rtol=1e-5)  # the 0.3-spread ages too
    assert result.std[4] == 1.0 and result.mean[4] == pytest.approx(7.0)  # constant: centred, not rescaled
    out = result.apply(pooled.astype(np.float32))
    np.testing.assert_allclose(out[:, :4].std(axis=0), 1.0, rtol=1e-4)
    np.testing.assert_allclose(out.mean(axis=0), 0.0, atol=1e-4)


def test_no_honest_value_is_clipped_at_the_chosen_scales() -> None:
    rows = clients()
    scales = choose_scales(pooled_pass(rows, "flags"), 5)
    means = pooled_pass(rows, "means", scales=scales)
    for x in rows:
        assert np.abs(statistics_vector(x, "means", 1.0, scales=scales)).max() < 1.0
        assert statistics_vector(x, "spread", 1.0, scales=scales, mean=means * scales).max() < 1.0


def test_flags_are_one_bit_per_feature_and_scale_and_a_feature_beyond_every_scale_is_named() -> None:
    x = np.array([[300.0, 0.5], [300.0, 0.5]], np.float32)
    flags = statistics_vector(x, "flags", 1.0).reshape(len(SCALES), 2)
    assert flags[:, 0].tolist() == [1, 1, 0, 0, 0, 0] and flags[:, 1].tolist() == [0] * len(SCALES)
    with pytest.raises(ValueError, match=r"feature\(s\) \[1\] exceed"):
        choose_scales(statistics_vector(np.array([[1.0, 3e12]], np.float32), "flags", 1.0), 2)
    huge = statistics_vector(np.array([[1.0, 3e38]], np.float32) * np.float32(1), "flags", 1.0)
    assert huge.reshape(len(SCALES), 2)[:, 1].tolist() == [1] * len(SCALES)  # squares to inf: over every scale


def test_no_rows_non_finite_rows_and_malformed_instructions_are_errors() -> None:
    with pytest.raises(ValueError, match="no training rows"):
        statistics_vector(np.zeros((0, 3), np.float32), "flags", 1.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        statistics_vector(np.array([[1.0, np.nan]], np.float32), "flags", 1.0)
    x = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="scales must be 2 finite positive values"):
        statistics_vector(x, "means", 1.0, scales=[1.0, -1.0])
    with pytest.raises(ValueError, match="mean must be 2 finite values"):
        statistics_vector(x, "spread", 1.0, scales=[1.0, 1.0], mean="abc")
    with pytest.raises(ValueError, match="unknown statistics pass"):
        statistics_vector(x, "median", 1.0, scales=[1.0, 1.0])


def test_images_keep_their_shape_and_both_splits_are_standardised() -> None:
    rng = np.random.default_rng(1)
    images = (rng.random((6, 1, 2, 2)) * 255).astype(np.float32)
    result = Standardization(np.full(4, 100.0, np.float32), np.full(4, 50.0, np.float32))
    data = ClientData(ArrayDataset(images, np.zeros(6, np.int64)), ArrayDataset(images[:2], np.zeros(2, np.int64)))
    out = standardized(data, result)
    assert out.train.x.shape == (6, 1, 2, 2) and out.train.x.dtype == np.float32
    np.testing.assert_allclose(out.test.x, (images[:2] - 100.0) / 50.0, rtol=1e-6)
    module = StandardizeInputs(4, result)
    np.testing.assert_allclose(module(torch.from_numpy(images)).numpy(), (images - 100.0) / 50.0, rtol=1e-6)
    with pytest.raises(ValueError, match="3 features"):
        result.apply(np.zeros((2, 3), np.float32))


def test_the_instruction_round_trips_and_a_missing_one_is_none() -> None:
    result = Standardization(np.array([1.5, -2.0], np.float32), np.array([0.5, 3.0], np.float32))
    again = Standardization.from_config(BASE.with_settings(result.to_settings()))
    assert again is not None
    np.testing.assert_array_equal(again.mean, result.mean)
    np.testing.assert_array_equal(again.std, result.std)
    assert Standardization.from_config(BASE) is None
    assert Standardization.from_config(BASE.with_settings({STD_MEAN: [1.0]})) is None  # the spread pass's centre alone
    assert Standardization.from_info(None) is None


values = st.one_of(st.none(), st.text(max_size=5), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                   st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                                      st.text(max_size=3)), max_size=6))


@given(mean=values, std=values)
def test_a_malformed_standardisation_from_the_server_is_a_value_error(mean: object, std: object) -> None:
    try:
        result = Standardization.from_config(TrainConfig(round=1, epochs=1, batch_size=1, lr=0.1, seed=0,
                                                         settings={"std-mean": mean, "std-std": std}))
    except ValueError as exc:  # refused as a setting (not a list of numbers) or as a standardisation
        assert "standardisation is malformed" in str(exc) or "is not a list of finite numbers" in str(exc)
        return
    assert result is not None
    assert np.isfinite(result.mean).all() and (result.std > 0).all() and np.isfinite(result.std).all()
    assert result.mean.shape == result.std.shape and result.mean.ndim == 1


@given(scales=values, mean=values, kind=st.sampled_from(["flags", "means", "spread", "x"]))
def test_a_pass_with_malformed_settings_is_a_value_error(scales: object, mean: object, kind: str) -> None:
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    try:
        vector = statistics_vector(x, kind, 1.0, scales=scales, mean=mean)
    except ValueError:
        return
    assert np.isfinite(vector).all() and np.abs(vector).max(initial=0) <= 1.0
