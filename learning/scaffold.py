"""SCAFFOLD's client side.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Algorithm 1, option II.

Client ``i`` starts from the global model ``x`` with the server's control
variate ``c`` and its own ``c_i``, and corrects every local gradient step::

    y_i <- y_i - lr * (g_i(y_i) + c - c_i)                       (K times)
    c_i+ = c_i - c + (x - y_i) / (K lr)                           (option II)

then sends ``y_i - x`` and ``c_i+ - c_i``. The correction is added to each
trainable parameter's gradient by a hook (:func:`corrected_gradients`), so it
applies to any task's own training loop; it is SCAFFOLD as the paper states
it for a loop of plain SGD steps (one backward pass a step). Both control
variates are held in the units of one local step (``lr * c``), as the server
keeps them (``aggregator.strategies.scaffold``): the correction is then
``(u - u_i) / lr`` and option II reads ``u_i+ = u_i - u + (x - y_i) / K``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

__all__ = ["StepCount", "corrected_gradients", "control_update"]


@dataclass
class StepCount:
    """Backward passes seen per corrected parameter; :attr:`steps` is ``K``."""

    counts: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        """Most backward passes any corrected parameter saw (0 before the first)."""
        return max(self.counts.values(), default=0)

    def hook(self, name: str, correction: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """Return a gradient hook for parameter ``name`` that adds ``correction`` and counts the pass."""

        def add(grad: torch.Tensor) -> torch.Tensor:
            self.counts[name] = self.counts.get(name, 0) + 1
            return grad + correction

        return add


@contextmanager
def corrected_gradients(model: nn.Module, names: tuple[str, ...] | list[str],
                        correction: np.ndarray) -> Iterator[StepCount]:
    """Add ``correction`` to every gradient the trainable parameters receive while the block runs.

    ``correction`` is flat, in the order of the trainable tensors ``names``.
    Yields the count of backward passes.

    A tensor among ``names`` that is not a parameter with ``requires_grad`` gets
    no gradient, hence no correction.
    """
    params = dict(model.named_parameters())
    shapes = model.state_dict(keep_vars=True)
    count, handles, offset = StepCount(), [], 0
    for name in names:
        size = shapes[name].numel()
        param = params.get(name)
        if param is not None and param.requires_grad:
            piece = torch.from_numpy(np.array(correction[offset:offset + size], dtype=np.float32))
            piece = piece.reshape(param.shape).to(device=param.device, dtype=param.dtype)
            handles.append(param.register_hook(count.hook(name, piece)))
        offset += size
    if offset != correction.size:
        for handle in handles:
            handle.remove()
        raise ValueError(f"correction has {correction.size} values; the trainable tensors hold {offset}")
    try:
        yield count
    finally:
        for handle in handles:
            handle.remove()


def control_update(own: np.ndarray, server: np.ndarray, delta: np.ndarray,
                   steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Option II in step units: ``(u_i+, u_i+ - u_i)`` with ``u_i+ = u_i - u - delta / K``.

    ``delta`` is ``y_i - x``; ``own`` is ``u_i = lr c_i``, ``server`` is ``u = lr c``.
    After no step at all (``K = 0``) the client's variate stays and its delta is zero.
    """
    if steps < 1:
        return own.copy(), np.zeros_like(own)
    new = (own - server - delta / np.float32(steps)).astype(np.float32, copy=False)
    return new, (new - own).astype(np.float32, copy=False)
