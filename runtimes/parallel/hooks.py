"""Synchronous data parallelism through torch's DDP, with its built-in communication hooks.

``quorum parallel --comm-hook fp16|powersgd`` trains the synchronous mode
with ``torch.nn.parallel.DistributedDataParallel`` and one of torch's own
gradient-compression hooks instead of the aggregation core's float32
all-reduce (:mod:`runtimes.parallel.sync`):

- ``fp16``: ``default_hooks.fp16_compress_hook``, gradients all-reduced in
  half precision (half the bytes);
- ``bf16``: ``default_hooks.bf16_compress_hook`` (torch runs it on NCCL only:
  refused on this mode's gloo backend, with that reason);
- ``powersgd``: ``powerSGD_hook.powerSGD_hook``, rank-``r`` low-rank
  gradient approximations with error feedback (Vogels, Karimireddy and
  Jaggi, "PowerSGD", NeurIPS 2019); the first ``start_iter`` steps are
  all-reduced uncompressed, as torch's hook does.

The step is the same weighted mean as the core's: DDP averages the ranks'
gradients, so each rank backpropagates its summed loss times ``W / B``
(``W`` ranks, ``B`` the step's examples over all ranks, known to every rank
from the shard sizes), and a rank whose batch is empty backpropagates a zero
loss so that it still joins the step's all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn import functional as F

from runtimes.parallel.comm import Comm
from runtimes.parallel.errors import ParallelError
from runtimes.parallel.mode import CommHook
from runtimes.parallel.sync import flat_momentum, load_flat_momentum

__all__ = ["HookedSyncSGD", "step_totals"]


def step_totals(sizes: Sequence[int], steps: int) -> list[int]:
    """Return the examples over all ranks in each of an epoch's ``steps`` steps.

    Shards are cut as ``torch.tensor_split`` cuts them: the first
    ``n % steps`` batches of a shard of ``n`` hold one example more.
    """
    return [sum(n // steps + (1 if s < n % steps else 0) for n in sizes) for s in range(steps)]


class HookedSyncSGD:
    """SGD over a DDP-wrapped model with a torch communication hook; the interface of ``SyncSGD``.

    Parameters
    ----------
    model : nn.Module
        Identical on every rank when training starts.
    comm : Comm
        The job's collectives (its byte counter counts the hook's payload).
    hook : CommHook
        Which of torch's hooks compresses the gradients.
    input_shape : Sequence[int]
        One example's shape (a rank with an empty batch runs a zero example).
    lr, momentum : float
        As for ``torch.optim.SGD``.
    powersgd_rank : int
        PowerSGD's matrix approximation rank.

    Raises
    ------
    ParallelError
        ``bf16`` on a backend other than NCCL.
    """

    def __init__(self, model: nn.Module, comm: Comm, hook: CommHook, input_shape: Sequence[int], *, lr: float,
                 momentum: float = 0.0, powersgd_rank: int = 1) -> None:
        if hook is CommHook.BF16 and dist.get_backend() != "nccl":
            raise ParallelError(f"--comm-hook bf16: torch's bf16_compress_hook runs on NCCL (GPUs) only, and this "
                                f"job runs on {dist.get_backend()}; use --comm-hook fp16 or powersgd")
        self.model, self.comm, self.hook = model, comm, hook
        self.ddp = nn.parallel.DistributedDataParallel(model)
        self.state: Any = None
        if hook is CommHook.POWERSGD:
            self.state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                                     start_powerSGD_iter=2, use_error_feedback=True,
                                                     warm_start=True)
        self.ddp.register_comm_hook(self.state, self._counting(_HOOKS[hook]))
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=lr, momentum=momentum)
        self.world, self.input_shape = comm.world, tuple(input_shape)
        self.totals: list[int] = []

    @property
    def size(self) -> int:
        """Return the number of trainable parameters."""
        return sum(p.numel() for p in self.params)

    def _counting(self, hook: Any) -> Any:
        """Wrap ``hook`` so that it counts what it hands to the collectives in ``comm.bytes_sent``.

        fp16: two bytes a value; PowerSGD: its P and Q factors and the tensors
        it leaves uncompressed, four bytes a value.
        """

        def counted(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            self.comm.bytes_sent += self._payload(bucket)  # before the hook: PowerSGD's warm-up counter moves in it
            future: torch.futures.Future[torch.Tensor] = hook(state, bucket)
            return future

        # DDP checks the annotations themselves, which postponed evaluation turned into strings
        counted.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                   "return": torch.futures.Future[torch.Tensor]}
        return counted

    def _payload(self, bucket: dist.GradBucket) -> int:
        """Return what the hook is about to hand to the collectives for ``bucket``, in bytes.

        fp16 (and bf16): two bytes a value; PowerSGD, past its warm-up, the P
        and Q factors of each matrix it compresses (its own
        ``_should_compress`` rule) and every other tensor in full, four bytes a
        value; during the warm-up, the whole bucket at four bytes a value.
        """
        values = bucket.buffer().numel()
        if self.hook is CommHook.FP16 or self.hook is CommHook.BF16:
            return 2 * values
        state = self.state
        if state is None or state.iter < state.start_powerSGD_iter:
            return 4 * values
        sent = 0
        for grad in bucket.gradients():
            if grad.dim() <= 1:
                sent += grad.numel()
                continue
            rows, cols = grad.shape[0], grad.numel() // grad.shape[0]
            compress, dense, low_rank = powerSGD_hook._should_compress(
                rows, cols, state.matrix_approximation_rank, state.min_compression_rate)
            sent += low_rank if compress else dense
        return 4 * sent

    def begin_epoch(self, sizes: Sequence[int], steps: int) -> None:
        """Set the examples each of the epoch's steps takes over all ranks (the weighted mean's denominator)."""
        self.totals = step_totals(sizes, steps)

    def step(self, x: torch.Tensor, y: torch.Tensor, index: int) -> float:
        """Step ``index`` of the epoch on this rank's batch (possibly empty); returns its summed loss."""
        self.optimizer.zero_grad(set_to_none=False)
        total = self.totals[index] if index < len(self.totals) else 0
        if int(y.shape[0]) and total:
            summed = F.cross_entropy(self.ddp(x), y, reduction="sum")
            objective, loss = summed * (self.world / total), float(summed.item())
        else:  # nothing to learn from: a zero loss still takes part in the step's all-reduce
            objective, loss = self.ddp(self._blank()).sum() * 0.0, 0.0
        with self.comm.guard(f"DDP all_reduce ({self.hook.value} hook)"):  # the hook runs inside backward
            objective.backward()
        self.optimizer.step()
        return loss

    def _blank(self) -> torch.Tensor:
        return torch.zeros((1, *self.input_shape), dtype=torch.float32)

    def momentum(self) -> np.ndarray | None:
        """Return the optimiser's momentum buffers as one flat array (``None`` before the first step)."""
        return flat_momentum(self.optimizer, self.params)

    def load_momentum(self, flat: np.ndarray) -> None:
        """Restore momentum buffers saved by :meth:`momentum` (for a resumed run)."""
        load_flat_momentum(self.optimizer, self.params, flat)


_HOOKS = {CommHook.FP16: default_hooks.fp16_compress_hook, CommHook.BF16: default_hooks.bf16_compress_hook,
          CommHook.POWERSGD: powerSGD_hook.powerSGD_hook}
