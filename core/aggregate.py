"""The aggregation core: a weighted mean over flat float32 buffers, as a monoid.

Every model travels and is aggregated as one contiguous 1-D float32 buffer.
The weighted mean is sum-decomposable, so it is written as a monoid::

    state = empty(size)
    state = add(state, update, weight)   # once per client reply, as it arrives
    state = merge(a, b)                  # partial states, e.g. across workers
    mean = finalize(state)

The aggregator therefore holds O(model) memory whatever the number of clients
(McMahan et al., "Communication-Efficient Learning of Deep Networks from
Decentralized Data", AISTATS 2017, Algorithm 1). ``add`` and ``merge`` accumulate
into the buffer of their first argument and return a new frozen state that
shares it: the old state must not be used again (it is consumed), which keeps
the hot path free of per-reply allocations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import UpdateRejected

__all__ = ["MeanState", "ACCUMULATORS", "empty", "widened", "add", "merge", "finalize", "check_update", "all_finite",
           "scaled_add", "block_scratch", "step_problem"]

# Updates are scaled and added block by block through a scratch this size (1 MiB of
# float32): the scaled block is still in cache when it is added, so a fold streams
# the update and the total once instead of also writing and re-reading a
# model-sized scratch; larger blocks gain nothing, smaller ones pay Python overhead.
_BLOCK = 1 << 18


@dataclass(frozen=True)
class MeanState:
    """Running weighted sum of updates.

    Attributes
    ----------
    total : np.ndarray
        ``sum_i w_i * x_i`` as a 1-D float32 buffer, or float64 for a run that
        accumulates in float64 (``[federation] accumulate``), owned by the state.
    weight : float
        ``sum_i w_i``.
    count : int
        Number of updates folded in.
    """

    total: np.ndarray
    weight: float
    count: int
    scratch: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        """Scalars in the running sum: the length of the flat model."""
        return int(self.total.shape[0])


#: What a running sum may accumulate in: float32 (the default, the fast path) or float64 (sums whose
#: order must not show: a tree of partial sums and a flat sum of the same updates agree to ~1e-16).
ACCUMULATORS = ("float32", "float64")


def empty(size: int, dtype: str = "float32") -> MeanState:
    """Return the identity element for a model of ``size`` parameters, accumulating in ``dtype``."""
    if size <= 0:
        raise ValueError(f"size must be positive, got {size}")
    if dtype not in ACCUMULATORS:
        raise ValueError(f"dtype must be one of {ACCUMULATORS}, got {dtype!r}")
    return MeanState(total=np.zeros(size, dtype=dtype), weight=0.0, count=0)


def widened(state: MeanState, dtype: str) -> MeanState:
    """Return ``state`` accumulating in ``dtype``: an empty float32 state becomes an empty float64 one.

    For the train workflows, which take their empty aggregate from the strategy
    (``Strategy.new_aggregate``) and widen it when the run accumulates in
    float64. A state that already holds updates is returned as it is.
    """
    if state.total.dtype == np.dtype(dtype) or state.count:
        return state
    return empty(state.size, dtype)


def all_finite(values: np.ndarray) -> bool:
    """Whether every entry of a float buffer is finite, in one read and no temporary.

    A NaN or an infinity makes the BLAS dot product ``values . values`` NaN or
    infinite, so a finite result proves every entry finite; only a result that
    overflowed from finite entries (|x| above ~1e19) needs the exact scan, which
    allocates a boolean mask.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.dot(values, values)):
            return True
    return bool(np.isfinite(values).all())


def check_update(update: np.ndarray, size: int, *, finite: bool = True) -> np.ndarray:
    """Validate one client update and return it as a 1-D float32 view.

    ``finite=False`` skips the NaN/Inf scan, for callers that decoded the
    update through :func:`core.replies.decode_flat`, which already did it.

    Raises
    ------
    UpdateRejected
        With the reason, when the update has the wrong dtype, shape or holds a
        NaN or an infinity. A rejected update never touches the running state.
    """
    if not isinstance(update, np.ndarray):
        raise UpdateRejected(f"update is a {type(update).__name__}, not an array")
    if update.dtype != np.float32:
        raise UpdateRejected(f"update dtype is {update.dtype}, expected float32")
    if update.ndim != 1 or update.shape[0] != size:
        raise UpdateRejected(f"update shape is {update.shape}, expected ({size},)")
    if finite and not all_finite(update):
        raise UpdateRejected("update holds NaN or Inf values")
    return update


def add(state: MeanState, update: np.ndarray, weight: float, *, checked: bool = False) -> MeanState:
    """Fold ``weight * update`` into ``state`` (consumes ``state``).

    ``checked=True`` skips the NaN/Inf scan for updates already validated.
    """
    if not weight > 0 or not np.isfinite(weight):
        raise UpdateRejected(f"weight must be a positive finite number, got {weight}")
    update = check_update(update, state.size, finite=not checked)
    total, scratch = state.total, state.scratch
    if weight == 1.0:
        np.add(total, update, out=total)
    elif total.dtype != np.float32:  # float64: each product w_i * x_i in float64, then summed
        if scratch is None:
            scratch = np.empty(min(_BLOCK, state.size), dtype=total.dtype)
        scaled_add(total, update, np.float64(weight), scratch)
    else:
        # numpy has no fused axpy ufunc: each scaled block goes through one small
        # scratch kept with the state, so no reply allocates and no pass leaves cache.
        if scratch is None:
            scratch = block_scratch(state.size)
        scaled_add(total, update, np.float32(weight), scratch)
    return MeanState(total, state.weight + float(weight), state.count + 1, scratch)


def block_scratch(size: int) -> np.ndarray:
    """Allocate a scratch buffer for :func:`scaled_add` over vectors of ``size`` values."""
    return np.empty(min(_BLOCK, size), dtype=np.float32)


def scaled_add(total: np.ndarray, update: np.ndarray, weight: np.floating[Any], scratch: np.ndarray) -> None:
    """``total += weight * update`` in place.

    BLAS ``saxpy`` does it in one fused pass over both buffers; numpy has no
    such ufunc, so the fallback scales one cache-sized block at a time through
    ``scratch`` (for buffers BLAS cannot take in place, and a float64 total,
    whose ``scratch`` and ``weight`` are float64 too).
    """
    saxpy = _blas_saxpy() if total.shape[0] >= _BLAS_MIN and total.dtype == np.float32 else None
    if saxpy is not None and total.flags.c_contiguous and update.flags.c_contiguous:
        result = saxpy(update, total, a=float(weight))
        if result is total or np.shares_memory(result, total):
            return
    block = scratch.shape[0]
    for start in range(0, total.shape[0], block):
        part, dest = update[start:start + block], total[start:start + block]
        scaled = scratch[: part.shape[0]]
        np.multiply(part, weight, out=scaled)
        np.add(dest, scaled, out=dest)


# Below this size the blocked numpy path is as fast, and scipy's BLAS (with its own
# thread pool) is never loaded: in torch.distributed workers that pool aborted the
# process at exit now and then ("terminate called without an active exception").
_BLAS_MIN = 1 << 20


@functools.cache
def _blas_saxpy() -> Callable[..., np.ndarray]:
    from scipy.linalg import blas  # a dependency, imported on first use only (see _BLAS_MIN)

    saxpy: Callable[..., np.ndarray] = blas.saxpy
    return saxpy


def merge(a: MeanState, b: MeanState) -> MeanState:
    """Combine two partial states (consumes ``a``)."""
    if a.size != b.size:
        raise ValueError(f"cannot merge states of sizes {a.size} and {b.size}")
    np.add(a.total, b.total, out=a.total)
    return MeanState(a.total, a.weight + b.weight, a.count + b.count, a.scratch)


def finalize(state: MeanState) -> np.ndarray:
    """Return the weighted mean ``sum_i w_i x_i / sum_i w_i`` as float32 (divided in the sum's own precision)."""
    if state.count == 0 or state.weight <= 0:
        raise ValueError("cannot finalize an empty aggregate: no update was added")
    return (state.total / float(state.weight)).astype(np.float32, copy=False)  # a Python float keeps the dtype


def step_problem(before: np.ndarray, after: np.ndarray, max_ratio: float) -> str | None:
    """Why a round's step ``before -> after`` must not be applied; ``None`` when it may.

    Refused: a model holding NaN or Inf (an overflowed sum, a server optimiser
    that blew up), and a step whose L2 norm exceeds
    ``max_ratio * max(1, |before|)`` (an exploding aggregate).
    """
    if not all_finite(after):
        return "the aggregated model holds NaN or Inf values"
    with np.errstate(over="ignore", invalid="ignore"):
        diff = np.subtract(after, before, dtype=np.float32)
        step = float(np.sqrt(np.dot(diff, diff)))
        bound = max_ratio * max(1.0, float(np.sqrt(np.dot(before, before))))
    if not step <= bound:
        return f"the round's step has norm {step:.4g}, over the bound {bound:.4g} (max_update_ratio x model norm)"
    return None
