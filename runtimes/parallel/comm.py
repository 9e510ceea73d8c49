"""Collectives of the data-parallel mode: the core's monoid state, all-reduced.

A worker's partial aggregate is an :class:`core.aggregate.MeanState` (sum
buffer, weight, count). Merging the states of every rank is ``aggregate.merge``
folded over them, and ``merge`` is elementwise addition, so the whole merge is
one SUM all-reduce of the *wire* buffer::

    wire = [ total_0 ... total_{P-1} | weight | count ]      (float32, P + 2)

The weight and the count ride in the same buffer as the sums, so a step costs
one collective per bucket, never one per tensor nor a second call for the
weight. A rank with nothing to contribute sends the identity element (zeros,
weight 0, count 0). Weights and counts are exact in float32 up to 2**24, far
above any batch or example count per round.

Large models are reduced in buckets (views of the one wire buffer, 25 MiB by
default, as PyTorch's DDP does); the buckets are launched together and waited
on together. Every collective runs under the process group's timeout and any
failure becomes :class:`~runtimes.parallel.errors.WorkerLost` naming the
operation and where the job was, so a dead or hung peer fails the job instead
of hanging it.
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core import aggregate
from core.strategy import ServerState
from runtimes.parallel.errors import WorkerLost

__all__ = ["WIRE_EXTRA", "DEFAULT_BUCKET_BYTES", "Comm", "wire_for", "pack", "unpack", "bucket_views",
           "release_process_group"]

WIRE_EXTRA = 2  # weight and count, appended after the sum buffer
DEFAULT_BUCKET_BYTES = 25 * 2**20


def _first_sentence(exc: BaseException) -> str:
    """Return the gist of a c10d/gloo error, without its source location or advice."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")


def release_process_group() -> None:
    """Destroy the default process group and let gloo's threads finish while Python is alive.

    Gloo's worker threads free each finished work item, and the tensors a
    work item holds can own Python objects, so freeing one takes the GIL. A
    thread that does so while the interpreter is finalizing is ended by
    CPython inside a ``noexcept`` destructor and the process aborts at exit
    ("terminate called without an active exception", SIGABRT), which loaded
    machines hit now and then. Destroying the group, then collecting the
    garbage that can still reference it (a DDP module in a reference cycle,
    for one), runs the group's destructor now: it drains the work queue and
    joins those threads with the GIL released.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def wire_for(size: int) -> torch.Tensor:
    """Return a zeroed wire buffer for a model of ``size`` parameters."""
    return torch.zeros(size + WIRE_EXTRA, dtype=torch.float32)


def pack(state: aggregate.MeanState, wire: np.ndarray) -> None:
    """Write ``state`` into ``wire`` (no copy of the sums when they already live there)."""
    size = state.size
    if wire.shape != (size + WIRE_EXTRA,):
        raise ValueError(f"wire has shape {wire.shape}; a state of size {size} needs ({size + WIRE_EXTRA},)")
    if state.total.ctypes.data != wire.ctypes.data:
        wire[:size] = state.total
    wire[size] = state.weight
    wire[size + 1] = state.count


def unpack(wire: np.ndarray) -> aggregate.MeanState:
    """Return the state held in ``wire``; its sums are a view of the buffer."""
    size = wire.shape[0] - WIRE_EXTRA
    return aggregate.MeanState(total=wire[:size], weight=float(wire[size]), count=int(round(float(wire[size + 1]))))


def bucket_views(buffer: torch.Tensor, bucket_bytes: int) -> tuple[torch.Tensor, ...]:
    """Split a flat buffer into contiguous views of at most ``bucket_bytes`` each."""
    if bucket_bytes < buffer.element_size():
        raise ValueError(f"bucket_bytes must hold at least one element, got {bucket_bytes}")
    views: tuple[torch.Tensor, ...] = buffer.split(bucket_bytes // buffer.element_size())
    return views


@dataclass
class Comm:
    """One rank's view of the job: rank, world size and the collectives it runs.

    ``bytes_sent`` counts the payload this rank hands to collectives (what a
    ring all-reduce moves is about twice that); ``where`` names the job's
    position (round, step) for error messages.
    """

    rank: int
    world: int
    timeout_s: float
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    bytes_sent: int = 0
    where: str = "startup"

    @contextmanager
    def _guard(self, op: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as exc:  # gloo/c10d raise RuntimeError subclasses for peer loss and timeouts
            raise WorkerLost(
                f"rank {self.rank}: {op} failed at {self.where}: another worker died, hung or left "
                f"(collective timeout {self.timeout_s:g} s): {_first_sentence(exc)}") from None

    def guard(self, op: str) -> AbstractContextManager[None]:
        """Run ``op`` (a collective outside this class: DDP's) under the job's failure handling."""
        return self._guard(op)

    def allreduce_(self, buffer: torch.Tensor) -> None:
        """Sum ``buffer`` over all ranks, in place, bucket by bucket."""
        self.bytes_sent += buffer.numel() * buffer.element_size()
        if self.world == 1:
            return
        with self._guard("all_reduce"):
            works = [dist.all_reduce(view, async_op=True) for view in bucket_views(buffer, self.bucket_bytes)]
            for work in works:
                work.wait()

    def merge(self, state: aggregate.MeanState, wire: torch.Tensor | None = None) -> aggregate.MeanState:
        """``aggregate.merge`` of every rank's ``state``: the same merged state on every rank."""
        if wire is None:
            wire = wire_for(state.size)
        array = wire.numpy()
        pack(state, array)
        self.allreduce_(wire)
        return unpack(array)

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum a small tensor (metrics, counts) over all ranks, in place."""
        self.allreduce_(tensor)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` on every rank with rank ``src``'s."""
        if self.rank == src:
            self.bytes_sent += tensor.numel() * tensor.element_size()
        if self.world == 1:
            return
        with self._guard("broadcast"):
            dist.broadcast(tensor, src=src)

    def barrier(self) -> None:
        """Wait until every rank reaches this point (nothing to wait for with one rank).

        Raises
        ------
        WorkerLost
            The barrier failed or timed out.
        """
        if self.world > 1:
            with self._guard("barrier"):
                dist.barrier()

    def broadcast_json(self, value: Any) -> Any:
        """Rank 0's JSON-able ``value`` on every rank (as JSON, never pickle)."""
        data = json.dumps(value).encode() if self.rank == 0 else b""
        length = torch.tensor([len(data)], dtype=torch.int64)
        self.broadcast_(length)
        payload = torch.zeros(int(length.item()), dtype=torch.uint8)
        if self.rank == 0:
            payload[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.broadcast_(payload)
        return json.loads(bytes(payload.numpy()).decode())

    def broadcast_state(self, state: ServerState | None, size: int) -> ServerState | None:
        """Rank 0's server state (or ``None``) on every rank: meta as JSON, buffers as float32."""
        meta = None if state is None else {
            "round": state.round, "wrapper_state": dict(state.wrapper_state),
            "slots": {k: int(v.size) for k, v in state.slots.items()}}
        meta = self.broadcast_json(meta)
        if meta is None:
            return None
        params = self._broadcast_array(state.params if state else None, size)
        slots = {k: self._broadcast_array(state.slots[k] if state else None, n) for k, n in meta["slots"].items()}
        return ServerState(params=params, slots=slots, round=int(meta["round"]), wrapper_state=meta["wrapper_state"])

    def _broadcast_array(self, array: np.ndarray | None, size: int) -> np.ndarray:
        buffer = torch.zeros(size, dtype=torch.float32)
        if self.rank == 0 and array is not None:
            buffer.numpy()[:] = np.asarray(array, dtype=np.float32).reshape(-1)
        self.broadcast_(buffer)
        return buffer.numpy()
