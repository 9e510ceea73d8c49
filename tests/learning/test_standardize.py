"""Federated standardisation's arithmetic: pooled moments from count-weighted means, worked out with numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from learning.datasets import ArrayDataset, ClientData
from learning.standardize import (
    MEAN_KEY,
    STD_KEY,
    Standardization,
    StandardizeInputs,
    moments_vector,
    standardized,
)


def clients(seed: int = 0) -> list[np.ndarray]:
    """Three devices' raw rows (pixels 0-255 and a column of incomes), of different sizes and spreads."""
    rng = np.random.default_rng(seed)
    out = []
    for n, shift in ((40, 0.0), (75, 30.0), (130, 90.0)):
        pixels = rng.integers(0, 256, size=(n, 3)).astype(np.float32)
        income = rng.normal(5_000 + 100 * shift, 800, size=(n, 1)).astype(np.float32)
        out.append(np.hstack([pixels + shift, income]))
    return out


def test_the_count_weighted_mean_of_the_vectors_gives_the_pooled_mean_and_std() -> None:
    rows = clients()
    scale, limit = 2.0**16, 1.0
    vectors = [moments_vector(x, scale, limit) for x in rows]
    counts = np.array([len(x) for x in rows], dtype=np.float64)
    mean_vector = (np.stack(vectors).astype(np.float64) * counts[:, None]).sum(axis=0) / counts.sum()
    result = Standardization.from_vector(mean_vector, 4, scale)
    pooled = np.concatenate(rows).astype(np.float64)
    np.testing.assert_allclose(result.mean, pooled.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(result.std, pooled.std(axis=0), rtol=1e-3)
    assert vectors[0][-1] == 0.0  # nothing over the limit at this scale


def test_values_beyond_the_scale_set_the_over_flag_and_are_clipped() -> None:
    x = np.full((5, 2), 300.0, np.float32)
    at_256 = moments_vector(x, 256.0, 1.0)
    assert at_256[-1] == 1.0 and np.abs(at_256[:-1]).max() == 1.0
    at_65536 = moments_vector(x, 65536.0, 1.0)
    assert at_65536[-1] == 0.0
    np.testing.assert_allclose(at_65536[:2] * 65536, 300.0, rtol=1e-6)
    np.testing.assert_allclose(at_65536[2:4] * 65536**2, 90_000.0, rtol=1e-6)
    # a secure-aggregation clip range below 1 is the limit
    assert moments_vector(np.full((2, 1), 0.6, np.float32), 1.0, 0.5)[-1] == 1.0


def test_a_constant_column_is_centred_but_not_rescaled() -> None:
    x = np.column_stack([np.full(50, 7.0), np.arange(50.0)]).astype(np.float32)
    result = Standardization.from_vector(moments_vector(x, 256.0, 1.0), 2, 256.0)
    assert result.std[0] == 1.0 and result.mean[0] == pytest.approx(7.0, rel=1e-6)
    out = result.apply(x)
    np.testing.assert_allclose(out[:, 0], 0.0, atol=1e-5)
    np.testing.assert_allclose(out[:, 1].mean(), 0.0, atol=1e-5)
    np.testing.assert_allclose(out[:, 1].std(), 1.0, rtol=1e-4)


def test_no_rows_or_non_finite_rows_are_errors() -> None:
    with pytest.raises(ValueError, match="no training rows"):
        moments_vector(np.zeros((0, 3), np.float32), 1.0, 1.0)
    with pytest.raises(ValueError, match="NaN or Inf"):
        moments_vector(np.array([[1.0, np.nan]], np.float32), 1.0, 1.0)
    with pytest.raises(ValueError, match="expected \\(5,\\)"):
        Standardization.from_vector(np.zeros(4), 2, 1.0)


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
    again = Standardization.from_extra(result.to_extra())
    assert again is not None
    np.testing.assert_array_equal(again.mean, result.mean)
    np.testing.assert_array_equal(again.std, result.std)
    assert Standardization.from_extra({"lr": 0.1}) is None
    assert Standardization.from_info(None) is None


values = st.one_of(st.none(), st.text(max_size=5), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                   st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                                      st.text(max_size=3)), max_size=6))


@given(mean=values, std=values)
def test_a_malformed_standardisation_from_the_server_is_a_value_error(mean: object, std: object) -> None:
    try:
        result = Standardization.from_extra({MEAN_KEY: mean, STD_KEY: std})
    except ValueError as exc:
        assert "standardisation is malformed" in str(exc)
        return
    assert result is not None
    assert np.isfinite(result.mean).all() and (result.std > 0).all() and np.isfinite(result.std).all()
    assert result.mean.shape == result.std.shape and result.mean.ndim == 1
