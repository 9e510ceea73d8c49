"""A scenario's federated data set: built from its ``[data]`` section, once per process.

:func:`build_federation` holds out the server's test set and partitions the
rest over the clients (eagerly, or, with ``partition = "resample"``, as
:class:`ResampledClients` recipes materialised on demand). Every part of one
process that needs the federation (the clients of an in-process run, the
server's held-out test set, a warm deployment worker) asks
:func:`cached_federation`, so the data set is read and partitioned once.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import overload

import numpy as np

from learning.datasets import (
    SYNTHETIC_CLASSES,
    SYNTHETIC_FEATURES,
    SYNTHETIC_TRAIN_FRACTION,
    ArrayDataset,
    ClientData,
    Federation,
    load_digits,
    load_file,
    load_mnist,
    split_train_test,
    synthetic_devices,
)
from learning.errors import DataError
from learning.partition import dirichlet, iid, shards
from scenarios.schema import Scenario
from scenarios.sections import DataSpec

__all__ = ["cached_federation", "build_federation", "ResampledClients"]


def cached_federation(scenario: Scenario) -> Federation:
    """Return the scenario's federated data set, built once per process."""
    clients = scenario.federation.clients
    copies = scenario.faults.byzantine_spec.iid_copies(clients, scenario.seed)
    return _federation(scenario.data, clients, scenario.seed, copies)


@functools.lru_cache(maxsize=2)
def _federation(spec: DataSpec, num_clients: int, seed: int, iid_copies: tuple[int, ...]) -> Federation:
    return build_federation(spec, num_clients, seed, iid_copies=iid_copies)


def build_federation(spec: DataSpec, num_clients: int, seed: int, *, iid_copies: Sequence[int] = ()) -> Federation:
    """Build the data of a whole federation from a scenario's data section.

    For MNIST, digits and files: hold out ``server_test_fraction`` of every
    class as the server test set, split the rest over ``num_clients`` with the
    chosen partitioner, then split each client's part into train and test by
    ``client_test_fraction``. FedProx Synthetic is naturally partitioned: one
    device per client, each split 90/10 into train and test as in the paper,
    and the server test set is the union of the devices' test splits (the
    ``partition`` and both test fractions are ignored).

    ``iid_copies`` (``[faults] byzantine.data = "iid"``): the other clients
    split the whole pool, and each of these draws, without replacement, an
    IID sample of the pool as large as an honest client's mean share: a copy of
    data the honest clients hold, so losing it costs the federation nothing.

    Raises
    ------
    DataError
        The data file is malformed, or the data cannot be split as asked.
    """
    copies = sorted(set(iid_copies))
    _check_copies(spec, copies, num_clients)
    holdout_ss, partition_ss, split_ss = np.random.SeedSequence(seed).spawn(3)
    if spec.dataset == "synthetic":
        return _synthetic_federation(spec, num_clients, np.random.default_rng(partition_ss))
    data = _load(spec)
    pool, test = _holdout(data, spec.server_test_fraction, np.random.default_rng(holdout_ss))
    if spec.partition == "resample":
        clients: Sequence[ClientData] = ResampledClients(pool, num_clients, spec, partition_ss)
        return Federation(clients, test, int(data.y.max()) + 1, tuple(data.x.shape[1:]))
    rng = np.random.default_rng(partition_ss)
    try:
        parts = _partition(spec, pool.y, num_clients - len(copies), rng)
    except ValueError as exc:
        raise DataError(f"{spec.dataset}: {exc}") from None
    parts = _with_copies(parts, copies, len(pool), rng)
    split_rng = np.random.default_rng(split_ss)
    clients = tuple(split_train_test(pool.subset(p), spec.client_test_fraction, split_rng) for p in parts)
    return Federation(clients, test, int(data.y.max()) + 1, tuple(data.x.shape[1:]))


class ResampledClients(Sequence[ClientData]):
    """Virtual clients that cost nothing until asked for: ``partition = "resample"``.

    Client ``i`` is a recipe, not data: from its own generator (the partition
    seed and ``i``) it draws label proportions ``p ~ Dir(alpha)``, then
    ``samples_per_client`` labels from ``p`` and, for each, an example of that
    class from the pool, with replacement; then it splits its distinct examples
    into train and test by ``client_test_fraction`` (an example drawn twice
    stays on one side). The only index kept is each class's
    example positions, computed once, so 10,000 clients cost what 10 do, and a
    client's data is materialised when it is sampled and dropped after.
    """

    def __init__(self, pool: ArrayDataset, num_clients: int, spec: DataSpec, seed: np.random.SeedSequence) -> None:
        self._pool, self._n, self._spec = pool, num_clients, spec
        labels, self._by_class = np.unique(pool.y, return_counts=True)
        # every class's example positions, one after another: class k's are order[starts[k]:starts[k + 1]]
        self._order = np.argsort(pool.y, kind="stable")
        self._starts = np.concatenate([[0], np.cumsum(self._by_class)[:-1]])
        self._alpha = np.full(len(labels), spec.alpha)
        self._entropy, self._key = seed.entropy, tuple(seed.spawn_key)

    def __len__(self) -> int:
        """Return the number of clients."""
        return self._n

    @overload
    def __getitem__(self, i: int) -> ClientData: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ClientData]: ...

    def __getitem__(self, i: int | slice) -> ClientData | Sequence[ClientData]:
        """Draw client ``i``'s data (a list of them for a slice) from its own seed.

        Raises
        ------
        IndexError
            ``i`` is not among the clients.
        """
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(f"client {i} of {self._n}")
        i %= self._n
        rng = np.random.default_rng(np.random.SeedSequence(self._entropy, spawn_key=(*self._key, i)))
        counts = rng.multinomial(self._spec.samples_per_client, rng.dirichlet(self._alpha))
        label = np.repeat(np.arange(len(counts)), counts)  # each draw's class, then a uniform member of it
        index = self._order[self._starts[label] + rng.integers(0, self._by_class[label])]
        # split by example, not by draw: an example drawn twice stays on one side, never in both
        unique, where = np.unique(index, return_inverse=True)
        n_test = min(int(round(self._spec.client_test_fraction * len(unique))), max(len(unique) - 1, 0))
        test = np.zeros(len(unique), bool)
        test[rng.permutation(len(unique))[:n_test]] = True
        held = test[where]
        return ClientData(self._pool.subset(index[~held]), self._pool.subset(index[held]))


def _load(spec: DataSpec) -> ArrayDataset:
    if spec.dataset == "mnist":
        return load_mnist()
    if spec.dataset == "digits":
        return load_digits()
    return load_file(spec.path, spec.label_column)


def _synthetic_federation(spec: DataSpec, num_clients: int, rng: np.random.Generator) -> Federation:
    devices = synthetic_devices(spec.synthetic_alpha, spec.synthetic_beta, num_clients, rng)
    clients = []
    for device in devices:
        cut = int(SYNTHETIC_TRAIN_FRACTION * len(device))  # as in the reference code
        index = np.arange(len(device))
        clients.append(ClientData(device.subset(index[:cut]), device.subset(index[cut:])))
    test = ArrayDataset(
        np.concatenate([c.test.x for c in clients]), np.concatenate([c.test.y for c in clients])
    )
    return Federation(tuple(clients), test, SYNTHETIC_CLASSES, (SYNTHETIC_FEATURES,))


def _partition(
    spec: DataSpec, labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    if spec.partition == "iid":
        return iid(labels, num_clients, rng)
    if spec.partition == "dirichlet":
        min_size = max(1, min(10, len(labels) // (2 * num_clients)))
        return dirichlet(labels, num_clients, spec.alpha, rng, min_size=min_size)
    return shards(labels, num_clients, spec.shards_per_client, rng)


def _check_copies(spec: DataSpec, copies: list[int], num_clients: int) -> None:
    if not copies:
        return
    if spec.dataset == "synthetic" or spec.partition == "resample":
        raise DataError(f"IID copies need a pooled data set to split; dataset {spec.dataset!r} with partition "
                        f"{spec.partition!r} has none")
    if copies[0] < 0 or copies[-1] >= num_clients or len(copies) >= num_clients:
        raise DataError(f"IID copies {copies} of {num_clients} clients: each must be a client id 0 .. "
                        f"{num_clients - 1}, and at least one client must stay honest")


def _with_copies(parts: list[np.ndarray], copies: list[int], pool_size: int,
                 rng: np.random.Generator) -> list[np.ndarray]:
    """Return the honest ``parts`` in order, with an IID sample of the pool at each id in ``copies``."""
    if not copies:
        return parts
    size, chosen, honest = int(round(pool_size / len(parts))), set(copies), iter(parts)
    return [np.sort(rng.choice(pool_size, size, replace=False)) if i in chosen else next(honest)
            for i in range(len(parts) + len(copies))]


def _holdout(
    data: ArrayDataset, fraction: float, rng: np.random.Generator
) -> tuple[ArrayDataset, ArrayDataset | None]:
    """Stratified split: ``round(fraction * n_k)`` examples of each class ``k`` go to the test set."""
    if fraction == 0:
        return data, None
    held = []
    for k in np.unique(data.y):
        members = rng.permutation(np.flatnonzero(data.y == k))
        held.append(members[: int(round(fraction * len(members)))])
    test_index = np.sort(np.concatenate(held))
    keep = np.ones(len(data), dtype=bool)
    keep[test_index] = False
    return data.subset(np.flatnonzero(keep)), data.subset(test_index)
