"""Split a labelled data set over clients: IID, label-wise Dirichlet, label shards.

Every partitioner takes the label vector of the pooled data and an
``np.random.Generator`` and returns one index array per client. The arrays are
disjoint, sorted, and together cover ``range(len(labels))`` exactly.
"""

from __future__ import annotations

import numpy as np

__all__ = ["iid", "dirichlet", "shards"]

_MAX_DIRICHLET_DRAWS = 1000


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle the examples and deal them out in near-equal parts.

    Parameters
    ----------
    labels : np.ndarray
        1-D labels of the pooled data (only the length is used).
    num_clients : int
        Number of parts; sizes differ by at most one.
    rng : np.random.Generator
        Source of the shuffle.

    Returns
    -------
    list of np.ndarray
        One sorted int64 index array per client.

    References
    ----------
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017, section 3 (the IID MNIST split).
    """
    n = _check(labels, num_clients)
    order = rng.permutation(n)
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Label-wise Dirichlet split: each class is spread over clients by ``Dir(alpha)``.

    For every class ``k`` a vector ``p_k ~ Dir(alpha * 1_N)`` is drawn and the
    examples of class ``k`` are cut in those proportions. As in Yurochkin et al.'s
    reference code, a client that already holds more than ``n / N`` examples
    gets no share of later classes, which keeps sizes from running away. The
    whole draw is repeated until every client has at least ``min_size`` examples.
    Small ``alpha`` gives each client few classes; large ``alpha`` tends to IID.

    Parameters
    ----------
    labels : np.ndarray
        1-D integer labels of the pooled data.
    num_clients : int
        Number of clients ``N``.
    alpha : float
        Dirichlet concentration, > 0.
    rng : np.random.Generator
        Source of all draws.
    min_size : int
        Fewest examples any client may get.

    Returns
    -------
    list of np.ndarray
        One sorted int64 index array per client.

    Raises
    ------
    ValueError
        ``alpha <= 0``, ``min_size * num_clients > len(labels)``, or no draw in
        1000 met ``min_size``.

    References
    ----------
    Yurochkin et al., "Bayesian Nonparametric Federated Learning of Neural
    Networks", ICML 2019; Hsu, Qi and Brown, "Measuring the Effects of
    Non-Identical Data Distribution for Federated Visual Classification", 2019.
    """
    n = _check(labels, num_clients)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if min_size * num_clients > n:
        raise ValueError(f"cannot give {num_clients} clients {min_size} examples each from {n}")
    by_class = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    for _ in range(_MAX_DIRICHLET_DRAWS):
        parts = _dirichlet_draw(by_class, num_clients, alpha, n, rng)
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(p) for p in parts]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split gave all {num_clients} clients {min_size} examples "
        f"in {_MAX_DIRICHLET_DRAWS} draws; raise alpha or lower min_size"
    )


def _dirichlet_draw(
    by_class: list[np.ndarray], num_clients: int, alpha: float, n: int, rng: np.random.Generator
) -> list[np.ndarray]:
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for members in by_class:
        members = rng.permutation(members)
        share = rng.dirichlet(np.full(num_clients, alpha))
        share = share * (sizes < n / num_clients)  # full clients take no more
        total = share.sum()
        share = share / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
        cuts = (np.cumsum(share) * len(members)).astype(np.int64)[:-1]
        for client, piece in enumerate(np.split(members, cuts)):
            parts[client].append(piece)
            sizes[client] += len(piece)
    return [np.concatenate(p).astype(np.int64) for p in parts]


def shards(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """McMahan's pathological non-IID split: sort by label, cut into shards, deal them out.

    The examples are sorted by label (ties in random order), cut into
    ``num_clients * shards_per_client`` contiguous shards of near-equal size,
    and each client gets ``shards_per_client`` shards chosen at random. With
    2 shards per client most clients see only two classes.

    Parameters
    ----------
    labels : np.ndarray
        1-D integer labels of the pooled data.
    num_clients : int
        Number of clients.
    shards_per_client : int
        Shards dealt to each client, > 0.
    rng : np.random.Generator
        Source of the tie order and the deal.

    Returns
    -------
    list of np.ndarray
        One sorted int64 index array per client.

    References
    ----------
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017, section 3 (the pathological non-IID split).
    """
    n = _check(labels, num_clients)
    if shards_per_client < 1 or num_clients * shards_per_client > n:
        raise ValueError(
            f"cannot cut {n} examples into {num_clients} x {shards_per_client} non-empty shards"
        )
    shuffled = rng.permutation(n)
    order = shuffled[np.argsort(labels[shuffled], kind="stable")]
    pieces = np.array_split(order, num_clients * shards_per_client)
    deal = rng.permutation(len(pieces)).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[s] for s in row])).astype(np.int64) for row in deal]


def _check(labels: np.ndarray, num_clients: int) -> int:
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    n = int(labels.shape[0])
    if not 1 <= num_clients <= n:
        raise ValueError(f"num_clients must be in [1, {n}] for {n} examples, got {num_clients}")
    return n
