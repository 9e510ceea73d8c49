"""Partitioners: every split is disjoint and complete, with the label statistics each promises."""

from __future__ import annotations

import numpy as np
import pytest

from learning.partition import dirichlet, iid, shards

TEN_BY_100 = np.repeat(np.arange(10), 100)  # sorted, like the MNIST 5k file


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n
    np.testing.assert_array_equal(np.sort(joined), np.arange(n))
    assert all(p.dtype == np.int64 for p in parts)


def test_iid_sizes_differ_by_at_most_one() -> None:
    # Prepare: 10 examples over 3 clients -> 4, 3, 3
    labels = np.zeros(10, dtype=np.int64)
    # Execute
    parts = iid(labels, 3, np.random.default_rng(0))
    # Assert
    assert [len(p) for p in parts] == [4, 3, 3]
    _assert_exact_cover(parts, 10)


def test_iid_is_a_seeded_shuffle() -> None:
    a = iid(TEN_BY_100, 4, np.random.default_rng(1))
    b = iid(TEN_BY_100, 4, np.random.default_rng(1))
    c = iid(TEN_BY_100, 4, np.random.default_rng(2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    # 250 draws without replacement from 1,000: every client sees all 10 labels
    assert all(len(np.unique(TEN_BY_100[p])) == 10 for p in a)


@pytest.mark.parametrize("alpha", [0.05, 0.5, 100.0])
def test_dirichlet_covers_and_respects_min_size(alpha: float) -> None:
    parts = dirichlet(TEN_BY_100, 10, alpha, np.random.default_rng(0), min_size=20)
    _assert_exact_cover(parts, 1000)
    assert min(len(p) for p in parts) >= 20


def _mean_top_label_share(parts: list[np.ndarray]) -> float:
    return float(np.mean([np.bincount(TEN_BY_100[p]).max() / len(p) for p in parts]))


def test_dirichlet_small_alpha_is_skewed_large_alpha_is_not() -> None:
    # IID over 10 balanced labels gives a top-label share near 0.1 (plus sampling noise);
    # alpha = 0.1 puts most of each client's data on one or two labels.
    skewed = dirichlet(TEN_BY_100, 10, 0.1, np.random.default_rng(0))
    even = dirichlet(TEN_BY_100, 10, 1000.0, np.random.default_rng(0))
    assert _mean_top_label_share(skewed) > 0.5
    assert _mean_top_label_share(even) < 0.2


def test_dirichlet_rejects_impossible_requests() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="cannot give 10 clients 101 examples"):
        dirichlet(TEN_BY_100, 10, 0.5, rng, min_size=101)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        dirichlet(TEN_BY_100, 10, 0.0, rng)


def test_shards_two_per_client_gives_at_most_two_labels() -> None:
    # 20 clients x 2 shards = 40 shards of 1000 / 40 = 25 examples; 100 per label
    # divides evenly, so every shard holds a single label.
    parts = shards(TEN_BY_100, 20, 2, np.random.default_rng(0))
    _assert_exact_cover(parts, 1000)
    assert [len(p) for p in parts] == [50] * 20
    assert max(len(np.unique(TEN_BY_100[p])) for p in parts) <= 2


def test_shards_one_per_client_gives_one_label_each() -> None:
    # 10 shards of 100 examples = exactly the 10 label blocks
    parts = shards(TEN_BY_100, 10, 1, np.random.default_rng(3))
    assert sorted(int(TEN_BY_100[p][0]) for p in parts) == list(range(10))
    assert all(len(np.unique(TEN_BY_100[p])) == 1 for p in parts)


def test_shards_cover_uneven_sizes() -> None:
    labels = np.random.default_rng(0).integers(0, 7, size=503)
    parts = shards(labels, 9, 3, np.random.default_rng(0))
    _assert_exact_cover(parts, 503)


@pytest.mark.parametrize("num_clients", [0, 1001])
def test_partitioners_reject_bad_client_counts(num_clients: int) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="num_clients must be in"):
        iid(TEN_BY_100, num_clients, rng)
    with pytest.raises(ValueError, match="num_clients must be in"):
        shards(TEN_BY_100, num_clients, 1, rng)
