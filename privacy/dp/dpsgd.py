"""Sample-level DP-SGD on one client: an example-level guarantee for its own data.

Abadi et al., "Deep Learning with Differential Privacy", CCS 2016, Algorithm 1:
each step samples a Poisson batch (every example joins with probability
``q = batch_size / n``), clips every example's gradient to L2 norm ``C``,
sums, adds ``N(0, (z C)^2)`` and divides by the expected batch size ``q n``.
The same RDP accountant as the server's (``dp-accounting``) composes the
steps into an epsilon for this client's data set.

Per-example gradients come from ``torch.func`` (``vmap`` over ``grad``), so
any model without batch statistics or in-model randomness works (the three
Quorum models do). Poisson batches and noise are drawn from the numpy
generator passed in, which outside tests is :func:`privacy.dp.secure_rng`.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F

from core.instructions import TrainConfig
from learning.datasets import ArrayDataset
from learning.training import TrainResult, train
from privacy.dp.errors import DPConfigError
from privacy.dp.mechanisms import gaussian_noise
from scenarios.threats import DPSpec

__all__ = ["train_dp_sgd", "dp_sgd_epsilon", "train_client", "DP_SGD_METRIC"]

#: The client metric carrying the sample-level epsilon of one client's DP-SGD training.
DP_SGD_METRIC = "dp-sgd-epsilon"

_CLIP_MARGIN = 1e-6  # as in privacy.dp.mechanisms: keep float32 norms strictly inside C

Params = dict[str, torch.Tensor]
PerExample = Callable[[Params, torch.Tensor, torch.Tensor], tuple[Params, torch.Tensor]]
Step = Callable[[Params, torch.Tensor, torch.Tensor, np.random.Generator], float]


def train_dp_sgd(
    model: nn.Module,
    data: ArrayDataset,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    noise_multiplier: float,
    max_grad_norm: float,
    delta: float,
    rng: np.random.Generator,
) -> tuple[TrainResult, float]:
    """Train ``model`` in place with DP-SGD; return the result and the epsilon spent.

    Parameters
    ----------
    model : nn.Module
        Trained in place; must not use batch norm or dropout.
    data : ArrayDataset
        The client's training set, not empty.
    epochs : int
        Passes over the data: ``epochs * ceil(n / batch_size)`` steps.
    batch_size : int
        Expected batch size; the sampling rate is ``batch_size / n`` (capped at 1).
    lr : float
        SGD step size.
    noise_multiplier : float
        ``z``: noise std on the summed clipped gradients over ``max_grad_norm``.
    max_grad_norm : float
        ``C``: L2 bound on each example's gradient.
    delta : float
        Delta of the reported epsilon (below ``1 / n`` to mean anything).
    rng : np.random.Generator
        Source of batches and noise; :func:`privacy.dp.secure_rng` outside
        tests (a seed the server knows, such as the round's training seed,
        would let it subtract the noise).

    Returns
    -------
    (TrainResult, float)
        Mean loss of the last epoch's sampled examples, ``n`` and the step
        count; and epsilon at ``delta`` for this client's examples
        (``inf`` when ``noise_multiplier`` is 0).
    """
    n = _check(model, data, epochs, batch_size, lr, noise_multiplier, max_grad_norm)
    sample = min(batch_size, n)
    steps_per_epoch = math.ceil(n / batch_size)
    x, y = torch.from_numpy(np.array(data.x)), torch.from_numpy(np.array(data.y))
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = {k: b.detach() for k, b in model.named_buffers()}
    step = _make_step(model, buffers, max_grad_norm, noise_multiplier * max_grad_norm, sample, lr)
    model.train()
    loss = 0.0
    for _ in range(epochs):
        total, seen = 0.0, 0
        for _ in range(steps_per_epoch):
            idx = torch.from_numpy(np.flatnonzero(rng.random(n) < sample / n))
            batch_loss = step(params, x[idx], y[idx], rng)
            total, seen = total + batch_loss, seen + len(idx)
        loss = total / max(seen, 1)
    steps = epochs * steps_per_epoch
    return TrainResult(loss=loss, num_examples=n, steps=steps), dp_sgd_epsilon(
        n, batch_size, steps, noise_multiplier, delta)


def train_client(model: nn.Module, data: ArrayDataset, config: TrainConfig, spec: DPSpec, *, seed: int,
                 rng: np.random.Generator) -> tuple[TrainResult, dict[str, float]]:
    """One client's local training as the scenario asks: DP-SGD when ``[dp] local_dp_sgd`` is on, else SGD.

    DP-SGD uses the round's epochs, batch size and learning rate with
    ``spec.local_noise_multiplier`` and ``spec.local_max_grad_norm`` (plain
    SGD steps: momentum and FedProx's proximal term are not applied), draws
    batches and noise from ``rng`` (:func:`privacy.dp.secure_rng` outside
    tests: the server knows ``seed``) and reports the sample-level epsilon at
    ``spec.delta`` as the :data:`DP_SGD_METRIC` metric (left out when
    infinite, that is without noise).
    """
    if not spec.local_dp_sgd:
        result = train(model, data, epochs=config.epochs, batch_size=config.batch_size, lr=config.lr,
                       momentum=config.momentum, proximal_mu=config.proximal_mu, seed=seed)
        return result, {}
    result, eps = train_dp_sgd(model, data, epochs=config.epochs, batch_size=config.batch_size, lr=config.lr,
                               noise_multiplier=spec.local_noise_multiplier, max_grad_norm=spec.local_max_grad_norm,
                               delta=spec.delta, rng=rng)
    return result, ({DP_SGD_METRIC: eps} if math.isfinite(eps) else {})


def dp_sgd_epsilon(n: int, batch_size: int, steps: int, noise_multiplier: float, delta: float) -> float:
    """Epsilon of ``steps`` Poisson-sampled Gaussian steps at rate ``batch_size / n``."""
    # dp-accounting costs about 1.2 s to import: only a client that trains with DP-SGD pays it, not every
    # ClientApp process (Flower starts one per message on a SuperNode)
    from privacy.dp.accountant import RoundEvent, epsilon_of

    return epsilon_of([RoundEvent("poisson", min(batch_size, n), n, noise_multiplier, steps)], delta)


def _make_step(model: nn.Module, buffers: Params, clip: float, noise_std: float, expected: int, lr: float) -> Step:
    """One DP-SGD step as a closure: per-example grads, clip, sum, noise, descend."""

    def example_loss(params: Params, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    per_example = vmap(grad_and_value(example_loss), in_dims=(None, 0, 0))

    def step(params: Params, xb: torch.Tensor, yb: torch.Tensor, rng: np.random.Generator) -> float:
        summed, loss = _clipped_sum(per_example, params, xb, yb, clip)
        with torch.no_grad():
            for name, p in params.items():
                noise = torch.from_numpy(gaussian_noise(p.numel(), noise_std, rng)).view_as(p)
                p.sub_((summed[name] + noise) * (lr / expected))
        return loss

    return step


def _clipped_sum(per_example: PerExample, params: Params, xb: torch.Tensor, yb: torch.Tensor,
                 clip: float) -> tuple[Params, float]:
    """Sum of per-example gradients, each clipped to ``clip``, and the batch's summed loss."""
    if len(yb) == 0:  # an empty Poisson batch still takes its (noise-only) step
        return {k: torch.zeros_like(p) for k, p in params.items()}, 0.0
    grads, losses = per_example(params, xb, yb)
    norms = torch.sqrt(functools.reduce(operator.add, (g.flatten(1).pow(2).sum(1) for g in grads.values())))
    factor = torch.clamp(clip * (1.0 - _CLIP_MARGIN) / norms.clamp_min(1e-12), max=1.0)
    summed = {k: torch.einsum("b,b...->...", factor, g) for k, g in grads.items()}
    return summed, float(losses.sum())


def _check(model: nn.Module, data: ArrayDataset, epochs: int, batch_size: int, lr: float,
           z: float, clip: float) -> int:
    if len(data) == 0:
        raise DPConfigError("local_dp_sgd", True, "cannot train on an empty data set")
    if epochs < 1 or batch_size < 1 or not lr > 0:
        raise DPConfigError("training", (epochs, batch_size, lr), "need epochs, batch_size >= 1 and lr > 0")
    if not z >= 0:
        raise DPConfigError("local_noise_multiplier", z, "must be >= 0")
    if not clip > 0:
        raise DPConfigError("local_max_grad_norm", clip, "must be > 0")
    if any(isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout)) for m in model.modules()):
        raise DPConfigError("local_dp_sgd", True, "DP-SGD needs a model without batch norm or dropout")
    return len(data)
