"""Synchronous data parallelism: every step's gradient is the weighted mean over ranks.

Each rank's gradient buffer *is* the sum part of a wire buffer (the
parameters' ``.grad`` are views of it, as with DDP's
``gradient_as_bucket_view``). Backward on the summed cross-entropy of the
local batch leaves ``sum_i grad l_i`` there: the monoid state after folding
each of the ``b`` examples' gradients with weight 1, which equals
``aggregate.add(aggregate.empty(P), mean_gradient, b)``. One all-reduce of the wire
merges the ranks' states, ``aggregate.finalize`` divides by the total weight
``sum_r b_r``, and every rank applies the same SGD step. The result is the
gradient of the mean loss over the concatenation of the ranks' batches, so
uneven batches (and ranks with none left) are weighted correctly.

References
----------
Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour",
2017 (synchronous SGD as one large batch); Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020 (flat buckets).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from core import aggregate
from runtimes.parallel.comm import Comm, wire_for
from runtimes.parallel.shards import epoch_batches

__all__ = ["SyncSGD", "run_epoch", "flat_momentum", "load_flat_momentum"]


class SyncSGD:
    """SGD (with heavy-ball momentum) whose every step is synchronised through the core.

    Parameters
    ----------
    model : nn.Module
        Identical on every rank when training starts.
    comm : Comm
        The job's collectives.
    lr, momentum : float
        As for ``torch.optim.SGD``.
    """

    def __init__(self, model: nn.Module, comm: Comm, *, lr: float, momentum: float = 0.0) -> None:
        self.model, self.comm = model, comm
        self.params = [p for p in model.parameters() if p.requires_grad]
        size = sum(p.numel() for p in self.params)
        self.wire = wire_for(size)
        self._sums = self.wire.numpy()[:size]
        _bind_grads(self.params, self.wire)
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum)

    @property
    def size(self) -> int:
        """Return the number of trainable parameters."""
        return int(self._sums.shape[0])

    def begin_epoch(self, sizes: Sequence[int], steps: int) -> None:
        """Nothing to prepare: the all-reduced weight is the step's denominator."""

    def step(self, x: torch.Tensor, y: torch.Tensor, index: int = 0) -> float:  # noqa: ARG002 (HookedSyncSGD's)
        """One synchronous step on this rank's batch (possibly empty); returns its summed loss."""
        self.wire.zero_()  # also zeroes every parameter's gradient
        n, loss = int(y.shape[0]), 0.0
        if n:
            total = F.cross_entropy(self.model(x), y, reduction="sum")
            total.backward()
            loss = float(total.item())
        local = aggregate.MeanState(total=self._sums, weight=float(n), count=int(n > 0))
        merged = self.comm.merge(local, self.wire)
        np.copyto(self._sums, aggregate.finalize(merged))
        self.optimizer.step()
        return loss

    def momentum(self) -> np.ndarray | None:
        """Return the optimiser's momentum buffers as one flat array (``None`` before the first step)."""
        return flat_momentum(self.optimizer, self.params)

    def load_momentum(self, flat: np.ndarray) -> None:
        """Restore momentum buffers saved by :meth:`momentum` (for a resumed run)."""
        load_flat_momentum(self.optimizer, self.params, flat)


def flat_momentum(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> np.ndarray | None:
    """SGD's momentum buffers of ``params`` as one flat array (``None`` before the first step)."""
    buffers = [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]
    if any(b is None for b in buffers):
        return None
    return torch.cat([b.reshape(-1) for b in buffers]).numpy().copy()


def load_flat_momentum(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], flat: np.ndarray) -> None:
    """Restore the momentum buffers :func:`flat_momentum` saved (a resumed run)."""
    size = sum(p.numel() for p in params)
    if flat.shape != (size,):
        raise ValueError(f"momentum buffer has shape {flat.shape}; expected ({size},)")
    offset = 0
    for p in params:
        chunk = torch.from_numpy(np.array(flat[offset:offset + p.numel()], dtype=np.float32))
        optimizer.state[p]["momentum_buffer"] = chunk.view_as(p).clone()
        offset += p.numel()


def _bind_grads(params: list[nn.Parameter], wire: torch.Tensor) -> None:
    """Make each parameter's ``.grad`` a view of the wire, so backward writes there."""
    offset = 0
    for p in params:
        p.grad = wire[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def run_epoch(trainer: Any, x: torch.Tensor, y: torch.Tensor, order: torch.Tensor,
              steps: int, label: str = "", sizes: Sequence[int] = ()) -> float:
    """Run ``steps`` synchronous steps over this rank's shard in ``order``; returns the summed loss.

    ``trainer`` is a :class:`SyncSGD` or a ``runtimes.parallel.hooks.HookedSyncSGD``;
    the batches are :func:`~runtimes.parallel.shards.epoch_batches`; ``sizes``
    are every rank's shard sizes; ``label`` (e.g. ``"round 3 epoch 1"``) names
    the position in errors.
    """
    trainer.model.train()
    trainer.begin_epoch(sizes, steps)
    loss = 0.0
    for step, batch in enumerate(epoch_batches(order, steps)):
        trainer.comm.where = f"{label} step {step + 1}/{steps}".strip()
        loss += trainer.step(x[batch], y[batch], step)
    return loss
