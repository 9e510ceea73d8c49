"""Local training and evaluation: plain mini-batch SGD with an optional FedProx term.

A round's local work is ``epochs`` passes over the data, or exactly ``steps``
mini-batches (``[training] local_steps``): passes in fresh random orders,
cycled until that many batches were taken, the last pass cut short.

Data are turned into tensors once per call (``torch.from_numpy``, no copy);
each epoch gathers the shuffled examples once and takes batches as views, so
there is no DataLoader overhead. The SGD step is written out (:class:`_SGD`,
the arithmetic of ``torch.optim.SGD`` on CPU): ``torch.optim`` imports
``torch._dynamo`` when an optimiser is built (and again checks it in ``step``),
about 2 s of CPU in every fresh process, and a deployed client is a fresh
process per message. Shuffling uses a ``torch.Generator`` seeded
from ``seed``: with one thread, the same seed gives the same weights bit for
bit. The number of torch threads is the caller's choice.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from learning.datasets import ArrayDataset

__all__ = ["TrainResult", "EvalResult", "train", "evaluate", "LossFn"]

#: A batch loss: ``(model output, targets) -> mean loss`` (cross-entropy by default).
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainResult:
    """What one local training returns: its loss, its examples and the SGD steps taken.

    The loss is the mean cross-entropy over the last epoch, or over every step
    when trained by ``steps`` (without the proximal term).
    """

    loss: float
    num_examples: int
    steps: int


@dataclass(frozen=True)
class EvalResult:
    """Mean cross-entropy and accuracy over ``num_examples`` (both 0.0 for an empty set)."""

    loss: float
    accuracy: float
    num_examples: int


def train(
    model: nn.Module,
    data: ArrayDataset | Any,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    proximal_mu: float = 0.0,
    seed: int,
    loss_fn: LossFn = F.cross_entropy,
    steps: int = 0,
) -> TrainResult:
    """Train ``model`` in place with mini-batch SGD on cross-entropy (or ``loss_fn``).

    With ``proximal_mu > 0`` the local objective is FedProx's
    ``F_k(w) + mu/2 * ||w - w_global||^2``, where ``w_global`` is the model's
    parameters when the call starts; its gradient ``mu * (w - w_global)`` is
    added to each step's gradient.

    Parameters
    ----------
    model : nn.Module
        Trained in place.
    data : ArrayDataset
        The local training set, not empty: anything with arrays ``x`` and ``y``
        (float targets for a regression ``loss_fn``).
    epochs, batch_size : int
        Passes over the data and examples per step (the last step of an epoch
        may be smaller).
    lr, momentum : float
        SGD step size and heavy-ball momentum.
    proximal_mu : float
        FedProx ``mu``; 0 gives FedAvg's local SGD.
    seed : int
        Seed of the shuffle order.
    loss_fn : callable
        The batch's mean loss from the model's output and the targets.
    steps : int
        When > 0, take exactly this many SGD steps instead of ``epochs``
        passes: each pass over the data draws a fresh order, a small data set
        is cycled, and the pass that reaches ``steps`` stops there.

    References
    ----------
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017, Algorithm 1 (ClientUpdate); Li et al.,
    "Federated Optimization in Heterogeneous Networks", MLSys 2020, Algorithm 2.
    """
    _check_args(data, epochs, batch_size, lr, momentum, proximal_mu)
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    x, y = _tensors(data)
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else None
    step = _Step(model, _SGD(params, lr=lr, momentum=momentum), params, anchor, proximal_mu, loss_fn)
    generator = torch.Generator().manual_seed(operator.index(seed))  # numpy ints too, not floats
    model.train()
    if steps:
        return TrainResult(loss=_steps(step, x, y, batch_size, generator, steps), num_examples=len(data),
                           steps=steps)
    loss = 0.0
    for _ in range(epochs):
        loss = _epoch(step, x, y, batch_size, generator)
    return TrainResult(loss=loss, num_examples=len(data), steps=epochs * -(-len(data) // batch_size))


class _SGD:
    """Heavy-ball SGD as ``torch.optim.SGD(params, lr, momentum)`` computes it on CPU, bit for bit.

    Its single-tensor path (no dampening, weight decay or Nesterov), without
    importing ``torch._dynamo``.
    """

    def __init__(self, params: list[nn.Parameter], lr: float, momentum: float) -> None:
        self.params, self.lr, self.momentum = params, lr, momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:  # as torch.optim: a parameter without a gradient is left alone
                continue
            grad = p.grad
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad)
                grad = buf
            p.add_(grad, alpha=-self.lr)


@dataclass(frozen=True)
class _Step:
    """One SGD step on a batch; adds FedProx's gradient ``mu * (w - w_global)`` when anchored."""

    model: nn.Module
    optimizer: _SGD
    params: list[nn.Parameter]
    anchor: list[torch.Tensor] | None
    mu: float
    loss_fn: LossFn = F.cross_entropy

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor) -> float:
        """Take the step; return the batch's summed cross-entropy (before the step)."""
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(xb), yb)
        loss.backward()
        if self.anchor is not None:
            with torch.no_grad():
                for p, p0 in zip(self.params, self.anchor, strict=True):
                    if p.grad is None:  # a parameter the loss does not reach
                        p.grad = torch.zeros_like(p)
                    p.grad.add_(p - p0, alpha=self.mu)
        self.optimizer.step()
        return loss.item() * len(yb)


def _epoch(
    step: _Step, x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator
) -> float:
    """One pass in a fresh random order; returns the example-weighted mean loss."""
    order = torch.randperm(len(y), generator=generator)
    xs, ys = x[order], y[order]  # one gather per epoch, then batches are views
    total = sum(step(xs[i:i + batch_size], ys[i:i + batch_size]) for i in range(0, len(ys), batch_size))
    return total / len(ys)


def _steps(step: _Step, x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator,
           steps: int) -> float:
    """Take ``steps`` batches, pass after pass in fresh random orders (as :func:`_epoch` draws them).

    Returns the example-weighted mean loss over every step.
    """
    total, seen, left = 0.0, 0, steps
    while left:
        order = torch.randperm(len(y), generator=generator)
        xs, ys = x[order], y[order]
        starts = range(0, len(ys), batch_size)[:left]
        total += sum(step(xs[i:i + batch_size], ys[i:i + batch_size]) for i in starts)
        seen += sum(len(ys[i:i + batch_size]) for i in starts)
        left -= len(starts)
    return total / seen


def evaluate(model: nn.Module, data: ArrayDataset, batch_size: int = 1024) -> EvalResult:
    """Mean cross-entropy and accuracy of ``model`` on ``data`` (no gradients, eval mode)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(data) == 0:
        return EvalResult(loss=0.0, accuracy=0.0, num_examples=0)
    x, y = _tensors(data)
    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(y), batch_size):
            logits = model(x[start:start + batch_size])
            yb = y[start:start + batch_size]
            loss_sum += F.cross_entropy(logits, yb, reduction="sum").item()
            correct += int((logits.argmax(dim=1) == yb).sum())
    return EvalResult(loss=loss_sum / len(y), accuracy=correct / len(y), num_examples=len(y))


def _tensors(data: ArrayDataset | Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = np.ascontiguousarray(data.x), np.ascontiguousarray(data.y)
    if not (x.flags.writeable and y.flags.writeable):  # torch warns on read-only memory
        x, y = x.copy(), y.copy()
    return torch.from_numpy(x), torch.from_numpy(y)


def _check_args(
    data: ArrayDataset | Any, epochs: int, batch_size: int, lr: float, momentum: float, mu: float
) -> None:
    if len(data) == 0:
        raise ValueError("cannot train on an empty data set")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    if not (lr > 0 and 0 <= momentum < 1 and mu >= 0):
        raise ValueError(f"need lr > 0, 0 <= momentum < 1, proximal_mu >= 0; got {lr}, {momentum}, {mu}")
