"""Which data each rank trains on, and in which order: pure functions of the scenario.

Ranks take the federation's clients round-robin: rank ``r`` of ``W`` owns
clients ``r, r + W, r + 2W, ...`` (so rank ``r`` *is* client ``r`` when there
are as many ranks as clients), and its shard is the union of their training
sets, in client order. Every rank builds the same federation from the
scenario's seed, so every rank knows every shard's size without talking.

The synchronous mode's batch schedule: every epoch has
``S = max_r ceil(n_r / b)`` steps (``b``: the scenario's batch size), so the
largest shard is visited in batches of at most ``b``. In epoch ``e`` (counted
from 1 over the whole run) rank ``r`` visits its shard in the order
``torch.randperm(n_r, generator=torch.Generator().manual_seed(client_seed(seed, e, r + 1)))``
and cuts that order into ``S`` consecutive, nearly equal batches
(``torch.tensor_split(order, S)``). Every step thus takes about ``n_r / S``
examples from each rank, the global batch stays about the same size all
epoch (no step is left with a last handful of examples), and a rank with
fewer than ``S`` examples contributes empty batches: the identity of the
weighted mean. One synchronous step equals one SGD step on the concatenation
of the ranks' batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from core.instructions import client_seed
from learning.datasets import ArrayDataset, Federation
from runtimes.parallel.errors import ParallelError

__all__ = ["assign_clients", "owner", "union", "shard_sizes", "steps_per_epoch", "epoch_order", "epoch_batches"]


def assign_clients(num_clients: int, world: int) -> list[list[int]]:
    """Client indices (partition ids) owned by each rank, round-robin."""
    if world < 1:
        raise ParallelError(f"the job needs at least one worker, got {world}")
    if world > num_clients:
        raise ParallelError(f"{world} workers but the scenario has only {num_clients} clients to shard; "
                            f"use at most {num_clients} workers or raise federation.clients")
    return [list(range(rank, num_clients, world)) for rank in range(world)]


def owner(client: int, world: int) -> int:
    """Return the rank that owns client index ``client``."""
    return client % world


def union(parts: Sequence[ArrayDataset]) -> ArrayDataset:
    """Concatenate the examples of ``parts``, one after the other."""
    return ArrayDataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]))


def shard_sizes(fed: Federation, world: int) -> list[int]:
    """Training examples in each rank's shard."""
    return [sum(len(fed.clients[c].train) for c in mine) for mine in assign_clients(fed.num_clients, world)]


def steps_per_epoch(sizes: Sequence[int], batch_size: int) -> int:
    """Return the synchronous steps per epoch: enough for the largest shard."""
    return max(math.ceil(n / batch_size) for n in sizes)


def epoch_order(size: int, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s visiting order of its shard in ``epoch`` (counted from 1)."""
    generator = torch.Generator().manual_seed(client_seed(seed, epoch, rank + 1))
    return torch.randperm(size, generator=generator)


def epoch_batches(order: torch.Tensor, steps: int) -> tuple[torch.Tensor, ...]:
    """Cut ``order`` into the epoch's ``steps`` batches: nearly equal consecutive parts (some may be empty)."""
    return torch.tensor_split(order, steps)
