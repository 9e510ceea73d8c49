"""Bundled data sets, FedProx Synthetic and whole federations."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from learning.datasets import (
    ArrayDataset,
    Federation,
    load_digits,
    load_mnist,
    synthetic_devices,
)
from learning.errors import DataError
from learning.federation import build_federation
from scenarios.sections import DataSpec


def _all_rows(fed: Federation) -> np.ndarray:
    sets = [d for c in fed.clients for d in (c.train, c.test)] + ([fed.test] if fed.test else [])
    return np.concatenate([d.x.reshape(len(d), -1) for d in sets])


def test_mnist_shape_scale_and_balance() -> None:
    data = load_mnist()
    assert data.x.shape == (5000, 1, 28, 28) and data.x.dtype == np.float32
    assert np.bincount(data.y).tolist() == [500] * 10
    # pixel 0 -> (0 - 0.1307) / 0.3081 = -0.424213; pixel 255 -> (1 - 0.1307) / 0.3081 = 2.821487
    assert data.x.min() == pytest.approx(-0.424213, abs=1e-5)
    assert data.x.max() == pytest.approx(2.821487, abs=1e-5)


def test_mnist_copies_do_not_share_the_cache() -> None:
    first = load_mnist()
    first.x[:] = 0.0
    assert load_mnist().x.max() > 2.0


def test_digits_shape_and_scale() -> None:
    data = load_digits()
    assert data.x.shape == (1797, 1, 8, 8) and data.y.dtype == np.int64
    assert data.x.min() == 0.0 and data.x.max() == 1.0  # 16 / 16


def test_array_dataset_rejects_mismatched_parts() -> None:
    with pytest.raises(ValueError, match="do not pair up"):
        ArrayDataset(np.zeros((3, 2), np.float32), np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="float32"):
        ArrayDataset(np.zeros((3, 2)), np.zeros(3, np.int64))


def test_synthetic_sample_counts_follow_the_law() -> None:
    # The sizes are the generator's first draw: floor(lognormal(4, 2)) + 50.
    devices = synthetic_devices(1.0, 1.0, 30, np.random.default_rng(7))
    expected = np.floor(np.random.default_rng(7).lognormal(4.0, 2.0, 30)).astype(int) + 50
    assert [len(d) for d in devices] == expected.tolist()
    assert all(d.x.shape == (len(d), 60) and d.y.max() < 10 for d in devices)


@pytest.fixture(scope="module")
def many_devices() -> list[ArrayDataset]:
    """400 devices with alpha = beta = 0 (every device's x has mean v_k ~ N(0, 1))."""
    return synthetic_devices(0.0, 0.0, 400, np.random.default_rng(1))


def test_synthetic_sizes_statistics(many_devices: list[ArrayDataset]) -> None:
    sizes = np.array([len(d) for d in many_devices])
    assert sizes.min() >= 50
    # median of floor(e^(4 + 2Z)) is floor(e^4) = 54 (+-2 standard errors: 40..72);
    # P(lognormal < 1) = P(Z < -2) = 0.0228, about 9 of 400 devices of exactly 50
    assert 40 <= np.median(sizes - 50) <= 72
    assert 2 <= np.sum(sizes == 50) <= 20


def test_synthetic_feature_variance_is_j_to_the_minus_1_2(many_devices: list[ArrayDataset]) -> None:
    big = max(many_devices, key=len)
    assert len(big) > 5000
    var = big.x.astype(np.float64).var(axis=0)
    for j in (1, 2, 10, 60):  # Sigma_jj = j^-1.2: 1, 0.435, 0.0631, 0.00735
        assert var[j - 1] == pytest.approx(j ** -1.2, rel=0.08)


def test_synthetic_is_deterministic_per_seed() -> None:
    a = synthetic_devices(0.5, 0.5, 5, np.random.default_rng(3))
    b = synthetic_devices(0.5, 0.5, 5, np.random.default_rng(3))
    c = synthetic_devices(0.5, 0.5, 5, np.random.default_rng(4))
    assert all(np.array_equal(p.x, q.x) and np.array_equal(p.y, q.y) for p, q in zip(a, b, strict=True))
    assert not np.array_equal(a[0].x[:50], c[0].x[:50])


def test_synthetic_federation_is_naturally_partitioned() -> None:
    spec = DataSpec(dataset="synthetic", synthetic_alpha=1.0, synthetic_beta=1.0, partition="shards")
    fed = build_federation(spec, 30, seed=0)
    assert fed.num_clients == 30 and fed.num_classes == 10 and fed.input_shape == (60,)
    for client in fed.clients:
        n = len(client.train) + len(client.test)
        assert n >= 50 and len(client.train) == int(0.9 * n)
    assert len(fed.test) == sum(len(c.test) for c in fed.clients)


def test_mnist_iid_federation_sizes() -> None:
    # 20% of each class (100 of 500) is held out; 4,000 left over 10 clients = 400 each,
    # of which round(0.1 * 400) = 40 go to the client's test split.
    fed = build_federation(DataSpec(dataset="mnist", partition="iid"), 10, seed=0)
    assert np.bincount(fed.test.y).tolist() == [100] * 10
    assert [(len(c.train), len(c.test)) for c in fed.clients] == [(360, 40)] * 10
    assert fed.input_shape == (1, 28, 28) and fed.num_classes == 10


def test_federation_sets_are_disjoint_and_complete() -> None:
    # the 5,000 MNIST images are pairwise distinct, so distinct rows prove disjointness
    fed = build_federation(DataSpec(dataset="mnist", partition="dirichlet", alpha=0.3), 20, seed=1)
    rows = _all_rows(fed)
    assert len(rows) == 5000
    assert len({row.tobytes() for row in rows}) == 5000


def test_iid_copies_are_samples_of_the_pool_the_honest_clients_split() -> None:
    # Prepare / Execute: 4,000 pooled images, 8 honest clients (alpha 0.1: each holds few classes), copies at 3 and 7
    spec = DataSpec(dataset="mnist", partition="dirichlet", alpha=0.1, client_test_fraction=0.0)
    fed = build_federation(spec, 10, seed=2, iid_copies=(7, 3))

    # Assert: the honest clients hold the whole pool, once (the images are pairwise distinct)
    honest = [c.train for i, c in enumerate(fed.clients) if i not in (3, 7)]
    rows = [row.tobytes() for d in honest for row in d.x.reshape(len(d), -1)]
    assert len(rows) == len(set(rows)) == 4000
    assert max(np.bincount(d.y, minlength=10).max() / len(d) for d in honest) > 0.5
    for i in (3, 7):
        copy = fed.clients[i].train
        mine = {row.tobytes() for row in copy.x.reshape(len(copy), -1)}
        assert len(copy) == len(mine) == 500 and mine <= set(rows)  # 4,000 / 8, no repeats, all from the pool
        # IID: each class near its pool share, 50 of 500 (hypergeometric sd about 6.5; 4 sd)
        assert np.all(np.abs(np.bincount(copy.y, minlength=10) - 50) < 26)


@pytest.mark.parametrize(("spec", "copies", "match"), [
    (DataSpec(dataset="digits"), (4,), r"each must be a client id 0 \.\. 3"),
    (DataSpec(dataset="digits"), (0, 1, 2, 3), "at least one client must stay honest"),
    (DataSpec(dataset="synthetic"), (1,), "dataset 'synthetic' with partition 'iid' has none"),
    (DataSpec(dataset="digits", partition="resample"), (1,), "partition 'resample' has none"),
])
def test_iid_copies_that_cannot_be_built_are_a_data_error(spec: DataSpec, copies: tuple, match: str) -> None:
    with pytest.raises(DataError, match=match):
        build_federation(spec, 4, seed=0, iid_copies=copies)


def test_digits_shards_federation() -> None:
    spec = DataSpec(dataset="digits", partition="shards", shards_per_client=2, server_test_fraction=0.0)
    fed = build_federation(spec, 10, seed=0)
    assert fed.test is None
    assert sum(len(c.train) + len(c.test) for c in fed.clients) == 1797
    labels = [np.concatenate([c.train.y, c.test.y]) for c in fed.clients]
    # 20 shards of ~90 over classes of ~180: a shard spans at most 2 labels, a client at most 4
    assert max(len(np.unique(y)) for y in labels) <= 4


def test_build_federation_is_deterministic_per_seed() -> None:
    spec = DataSpec(dataset="digits", partition="dirichlet", alpha=0.5)
    a, b, c = (build_federation(spec, 5, seed=s) for s in (4, 4, 5))
    assert all(np.array_equal(p.train.y, q.train.y) and np.array_equal(p.train.x, q.train.x)
               for p, q in zip(a.clients, b.clients, strict=True))
    assert not all(np.array_equal(p.train.y, q.train.y) for p, q in zip(a.clients, c.clients, strict=True))


def test_build_federation_from_a_user_file(tmp_path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 3)), np.repeat(np.arange(4), 50)
    path = tmp_path / "mine.npz"
    np.savez(path, x=x, y=y)
    spec = DataSpec(dataset="file", path=str(path), partition="iid", server_test_fraction=0.25)
    fed = build_federation(spec, 5, seed=0)
    # 25% of each label (12.5 -> round half to even = 12) is held out: 48; 152 left over 5 clients
    assert len(fed.test) == 48
    assert fed.num_classes == 4 and fed.input_shape == (3,)
    assert sum(len(c.train) + len(c.test) for c in fed.clients) == 152


def test_too_many_clients_is_a_data_error() -> None:
    with pytest.raises(DataError, match="digits: num_clients must be in"):
        build_federation(DataSpec(dataset="digits"), 5000, seed=0)


def _peak_bytes(build: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        kept = build()
        return tracemalloc.get_traced_memory()[1] + 0 * id(kept)
    finally:
        tracemalloc.stop()


def test_resampled_clients_are_recipes_drawn_from_the_training_pool() -> None:
    # Prepare: 10,000 virtual clients of 40 examples over MNIST's 4,000-image training pool
    spec = DataSpec(dataset="mnist", partition="resample", samples_per_client=40, alpha=0.5,
                    client_test_fraction=0.25)

    # Execute
    fed = build_federation(spec, 10_000, seed=0)
    again = build_federation(spec, 10_000, seed=0)
    other_seed = build_federation(spec, 10_000, seed=1)

    # Assert: 10,000 clients at the memory cost of 10 (the data set keeps a per-class index only)
    assert fed.num_clients == 10_000
    assert _peak_bytes(lambda: build_federation(spec, 10_000, seed=0)) < 1.2 * _peak_bytes(
        lambda: build_federation(spec, 10, seed=0))
    client = fed.clients[9_999]
    assert len(client.train) + len(client.test) == 40
    # a quarter of the distinct examples are held out; one drawn twice is never on both sides
    train_rows = {row.tobytes() for row in client.train.x.reshape(len(client.train), -1)}
    test_rows = {row.tobytes() for row in client.test.x.reshape(len(client.test), -1)}
    assert not train_rows & test_rows
    assert len(test_rows) == round(0.25 * len(train_rows | test_rows))
    # a client is the same recipe every time it is materialised, and another seed is another client
    assert np.array_equal(client.train.x, again.clients[9_999].train.x)
    assert not np.array_equal(client.train.x, other_seed.clients[9_999].train.x)
    assert np.array_equal(fed.clients[-1].train.y, client.train.y)
    # every example comes from the training pool, never the server's held-out images
    held_out = {row.tobytes() for row in fed.test.x.reshape(len(fed.test), -1)}
    rows = np.concatenate([fed.clients[i].train.x for i in range(0, 10_000, 500)]).reshape(-1, 784)
    assert not held_out & {row.tobytes() for row in rows}
    with pytest.raises(IndexError, match="client 10000 of 10000"):
        fed.clients[10_000]


def test_resampled_label_skew_follows_alpha() -> None:
    # Dir(alpha) proportions: the expected share of a client's most common label is far higher for
    # alpha = 0.1 (most mass on one class) than for alpha = 100 (close to uniform, about 0.1 + noise)
    def top_share(alpha: float) -> float:
        spec = DataSpec(dataset="mnist", partition="resample", samples_per_client=200, alpha=alpha,
                        client_test_fraction=0.0)
        fed = build_federation(spec, 200, seed=3)
        return float(np.mean([np.bincount(fed.clients[i].train.y, minlength=10).max() / 200 for i in range(200)]))

    assert top_share(0.1) > 0.6
    assert top_share(100.0) < 0.2
