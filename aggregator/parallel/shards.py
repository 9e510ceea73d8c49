"""Which data each rank trains on, and in which order: pure functions of the scenario.

Ranks take the federation's clients round-robin: rank ``r`` of ``W`` owns
clients ``r, r + W, r + 2W, ...`` (so rank ``r`` *is* client ``r`` when there
are as many ranks as clients), and its shard is the union of their training
sets, in client order. Every rank builds the same federation from the
scenario's seed, so every rank knows every shard's size without talking.

The synchronous mode's batch schedule: in epoch ``e`` (counted from 1 over
the whole run) rank ``r`` visits its shard in the order
``torch.randperm(n_r, generator=torch.Generator().manual_seed(client_seed(seed, e, r + 1)))``
and takes batch ``t`` as positions ``[t*b, (t+1)*b)`` of that order. All
ranks run ``max_r ceil(n_r / b)`` steps per epoch; a rank whose shard is used
up contributes an empty batch (the identity of the weighted mean), so one
synchronous step equals one SGD step on the concatenation of the ranks'
batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from aggregator.parallel.errors import ParallelError
from aggregator.rounds import client_seed
from clients.datasets import ArrayDataset, Federation

__all__ = ["assign_clients", "owner", "union", "shard_sizes", "steps_per_epoch", "epoch_order", "batch_slice"]


def assign_clients(num_clients: int, world: int) -> list[list[int]]:
    """Client indices (partition ids) owned by each rank, round-robin."""
    if world < 1:
        raise ParallelError(f"the job needs at least one worker, got {world}")
    if world > num_clients:
        raise ParallelError(f"{world} workers but the scenario has only {num_clients} clients to shard; "
                            f"use at most {num_clients} workers or raise federation.clients")
    return [list(range(rank, num_clients, world)) for rank in range(world)]


def owner(client: int, world: int) -> int:
    """The rank that owns client index ``client``."""
    return client % world


def union(parts: Sequence[ArrayDataset]) -> ArrayDataset:
    """The examples of ``parts`` one after the other."""
    return ArrayDataset(np.concatenate([p.x for p in parts]), np.concatenate([p.y for p in parts]))


def shard_sizes(fed: Federation, world: int) -> list[int]:
    """Training examples in each rank's shard."""
    return [sum(len(fed.clients[c].train) for c in mine) for mine in assign_clients(fed.num_clients, world)]


def steps_per_epoch(sizes: Sequence[int], batch_size: int) -> int:
    """Synchronous steps per epoch: enough for the largest shard."""
    return max(math.ceil(n / batch_size) for n in sizes)


def epoch_order(size: int, seed: int, epoch: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s visiting order of its shard in ``epoch`` (counted from 1)."""
    generator = torch.Generator().manual_seed(client_seed(seed, epoch, rank + 1))
    return torch.randperm(size, generator=generator)


def batch_slice(step: int, batch_size: int) -> slice:
    """Positions of batch ``step`` in an epoch's order (may run past the shard: an empty batch)."""
    return slice(step * batch_size, (step + 1) * batch_size)
