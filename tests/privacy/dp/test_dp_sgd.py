"""Sample-level DP-SGD on a client (Abadi et al. 2016) with torch.func per-example gradients."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.rdp import RdpAccountant
from dp_support import blobs
from torch import nn
from torch.func import grad_and_value, vmap
from torch.nn import functional as F

from learning.datasets import ArrayDataset
from learning.models import build_model, get_flat
from learning.training import evaluate
from privacy.dp.dpsgd import _clipped_sum, train_dp_sgd
from privacy.dp.errors import DPConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_per_example_clipping_matches_one_backward_per_example(rng: np.random.Generator) -> None:
    # Prepare: a logistic regression and 6 examples
    model = build_model("logreg", (10,), 2, seed=1)
    data = blobs(6, rng)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    params = {k: p.detach() for k, p in model.named_parameters()}

    def example_loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(torch.func.functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    # Execute
    summed, loss = _clipped_sum(vmap(grad_and_value(example_loss), in_dims=(None, 0, 0)), params, x, y, 0.05)
    # Assert: the same by hand, one backward pass and one clip per example
    expected = {k: torch.zeros_like(p) for k, p in params.items()}
    losses = 0.0
    for i in range(6):
        model.zero_grad()
        li = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
        li.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
        for k, p in model.named_parameters():
            expected[k] += p.grad * min(1.0, 0.05 / norm)
        losses += float(li.detach())
    for k in params:
        torch.testing.assert_close(summed[k], expected[k], rtol=1e-4, atol=1e-7)
    assert loss == pytest.approx(losses, rel=1e-5)


def test_epsilon_is_the_poisson_subsampled_gaussian_of_all_steps(rng: np.random.Generator) -> None:
    model = build_model("logreg", (10,), 2, seed=0)
    result, eps = train_dp_sgd(model, blobs(600, rng), epochs=2, batch_size=60, lr=0.1,
                               noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-4, rng=rng)
    accountant = RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.1)), 20)
    assert result.steps == 20 and result.num_examples == 600
    assert eps == pytest.approx(accountant.get_epsilon(1e-4), rel=1e-12)


def test_dp_sgd_learns_separable_data(rng: np.random.Generator) -> None:
    model = build_model("logreg", (10,), 2, seed=0)
    data = blobs(1000, rng)
    result, eps = train_dp_sgd(model, data, epochs=3, batch_size=50, lr=0.5, noise_multiplier=1.0,
                               max_grad_norm=1.0, delta=1e-4, rng=rng)
    assert evaluate(model, blobs(500, rng)).accuracy > 0.95
    assert math.isfinite(result.loss) and 0 < eps < 10


def test_dp_sgd_is_reproducible_for_a_seeded_generator_and_runs_a_cnn() -> None:
    data = ArrayDataset(np.random.default_rng(0).standard_normal((40, 1, 8, 8)).astype(np.float32),
                        np.arange(40, dtype=np.int64) % 3)
    flats = []
    for _ in range(2):
        model = build_model("cnn", (1, 8, 8), 3, seed=0)
        train_dp_sgd(model, data, epochs=1, batch_size=10, lr=0.1, noise_multiplier=0.5, max_grad_norm=1.0,
                     delta=1e-3, rng=np.random.default_rng(5))
        flats.append(get_flat(model))
    np.testing.assert_array_equal(flats[0], flats[1])


def test_dp_sgd_refuses_batch_norm_and_bad_settings(rng: np.random.Generator) -> None:
    data = blobs(10, rng)
    with pytest.raises(DPConfigError, match="batch norm"):
        train_dp_sgd(nn.Sequential(nn.Linear(10, 2), nn.BatchNorm1d(2)), data, epochs=1, batch_size=5, lr=0.1,
                     noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-3, rng=rng)
    with pytest.raises(DPConfigError, match="local_max_grad_norm"):
        train_dp_sgd(build_model("logreg", (10,), 2), data, epochs=1, batch_size=5, lr=0.1,
                     noise_multiplier=1.0, max_grad_norm=0.0, delta=1e-3, rng=rng)
