"""Local SGD, the FedProx proximal term, determinism, and evaluation."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from learning.datasets import ArrayDataset
from learning.models import build_model, get_flat, set_flat
from learning.training import _SGD, EvalResult, evaluate, train
from tests.conftest import REPO


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Bit-for-bit determinism is promised for a single thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _blobs(n: int = 120, seed: int = 0) -> ArrayDataset:
    """Three Gaussian blobs in 4-D, centres 3 apart: nearly separable."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    x = rng.normal(size=(n, 4)) + 3.0 * np.eye(3, 4)[y]
    return ArrayDataset(x.astype(np.float32), y.astype(np.int64))


def test_training_lowers_the_loss_and_counts_steps() -> None:
    data, model = _blobs(), build_model("logreg", (4,), 3, seed=0)
    before = evaluate(model, data).loss
    result = train(model, data, epochs=2, batch_size=32, lr=0.1, seed=0)
    # 120 examples in batches of 32: 4 steps per epoch (32, 32, 32, 24), 2 epochs
    assert (result.steps, result.num_examples) == (8, 120)
    after = evaluate(model, data)
    assert after.loss < 0.5 * before and after.accuracy > 0.9
    assert math.isfinite(result.loss)


def test_full_batch_step_matches_sgd_by_hand() -> None:
    # one epoch with batch = all data is one gradient step: w1 = w0 - lr * grad(w0)
    data, model = _blobs(), build_model("logreg", (4,), 3, seed=0)
    w0 = get_flat(model)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = w0 - 0.3 * torch.cat([g.reshape(-1) for g in grads]).numpy()
    result = train(model, data, epochs=1, batch_size=len(data), lr=0.3, seed=0)
    np.testing.assert_allclose(get_flat(model), expected, rtol=1e-5, atol=1e-6)
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)


def test_proximal_step_by_hand() -> None:
    # two full-batch steps with mu: w1 = w0 - lr*g(w0); w2 = w1 - lr*(g(w1) + mu*(w1 - w0))
    data, lr, mu = _blobs(), 0.3, 2.0
    ref = build_model("logreg", (4,), 3, seed=0)
    w0 = get_flat(ref)
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)

    def grad_at(w: np.ndarray) -> np.ndarray:
        set_flat(ref, w)
        grads = torch.autograd.grad(F.cross_entropy(ref(x), y), list(ref.parameters()))
        return torch.cat([g.reshape(-1) for g in grads]).numpy()

    w1 = w0 - lr * grad_at(w0)
    w2 = w1 - lr * (grad_at(w1) + mu * (w1 - w0))
    model = build_model("logreg", (4,), 3, seed=0)
    train(model, data, epochs=2, batch_size=len(data), lr=lr, proximal_mu=mu, seed=0)
    np.testing.assert_allclose(get_flat(model), w2, rtol=1e-5, atol=1e-6)


def test_huge_mu_keeps_weights_near_the_start() -> None:
    # with lr * mu = 1 each step snaps back to w0 - lr * g, so the distance stays ~ lr * |g|
    data = _blobs()
    free, held = (build_model("logreg", (4,), 3, seed=0) for _ in range(2))
    w0 = get_flat(free)
    train(free, data, epochs=5, batch_size=8, lr=0.05, seed=0)
    train(held, data, epochs=5, batch_size=8, lr=0.05, proximal_mu=20.0, seed=0)
    moved_free = np.linalg.norm(get_flat(free) - w0)
    moved_held = np.linalg.norm(get_flat(held) - w0)
    assert moved_held < 0.1 * moved_free


def test_same_seed_same_bits_other_seed_other_bits() -> None:
    data = _blobs(200)
    runs = []
    for seed in (7, np.int64(7), 8):  # a numpy integer seed is the same seed
        model = build_model("mlp", (4,), 3, seed=0)
        train(model, data, epochs=2, batch_size=16, lr=0.05, momentum=0.9, seed=seed)
        runs.append(get_flat(model))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_cnn_trains_on_digit_shaped_input() -> None:
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.normal(size=(64, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 64))
    model = build_model("cnn", (1, 8, 8), 10, seed=0)
    result = train(model, data, epochs=1, batch_size=16, lr=0.05, seed=0)
    assert result.steps == 4 and math.isfinite(result.loss)


def test_evaluate_by_hand() -> None:
    # logits = x with W = I, b = 0. x = e0 with label 0: CE = log(1 + e^-1) = 0.313262;
    # x = e0 with label 1: CE = log(1 + e) = 1.313262; x = e1 with label 1: 0.313262.
    model = build_model("logreg", (2,), 2)
    set_flat(model, np.array([1, 0, 0, 1, 0, 0], np.float32))
    x = np.array([[1, 0], [0, 1], [1, 0], [0, 1]], np.float32)
    result = evaluate(model, ArrayDataset(x, np.array([0, 1, 1, 1])), batch_size=3)
    assert result.accuracy == 0.75 and result.num_examples == 4
    assert result.loss == pytest.approx((3 * 0.313262 + 1.313262) / 4, abs=1e-6)


def test_empty_sets() -> None:
    model = build_model("logreg", (2,), 2)
    empty = ArrayDataset(np.zeros((0, 2), np.float32), np.zeros(0, np.int64))
    assert evaluate(model, empty) == EvalResult(loss=0.0, accuracy=0.0, num_examples=0)
    with pytest.raises(ValueError, match="empty data set"):
        train(model, empty, epochs=1, batch_size=8, lr=0.1, seed=0)


def test_read_only_data_trains_without_warnings() -> None:
    data = _blobs()
    data.x.flags.writeable = False
    train(build_model("logreg", (4,), 3), data, epochs=1, batch_size=32, lr=0.1, seed=0)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_matches_torch_optim_sgd_bit_for_bit(momentum: float) -> None:
    # Quorum's written-out step (no torch._dynamo import) against torch.optim.SGD doing the same work: the same
    # data, order and initial weights; a 2NN whose second layer is frozen-by-absence on odd steps (no gradient)
    def run(use_torch: bool) -> list[torch.Tensor]:
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.07, momentum=momentum) if use_torch else _SGD(params, 0.07, momentum)
        data = _blobs(60, seed=1)
        x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
        for i in range(12):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[i * 5:(i + 1) * 5]), y[i * 5:(i + 1) * 5])
            loss.backward()
            if i % 2:
                params[2].grad = params[3].grad = None  # skipped this step by both, momentum buffer kept
            opt.step()
        return [p.detach().clone() for p in params]

    ours, theirs = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    torch.manual_seed(3)
    assert not torch.equal(ours[0], torch.nn.Linear(4, 8).weight)  # it did train


@pytest.mark.e2e  # a fresh interpreter (docs/testing.md)
def test_training_does_not_import_torch_dynamo() -> None:
    # building a torch.optim optimiser imports torch._dynamo (about 2 s of CPU); a deployed client is a fresh
    # process per message, so local training must not
    code = ("import sys, numpy as np\n"
            "from learning.datasets import ArrayDataset\nfrom learning.models import build_model\n"
            "from learning.training import train\n"
            "data = ArrayDataset(np.ones((8, 4), np.float32), np.arange(8) % 3)\n"
            "train(build_model('mlp', (4,), 3, seed=0), data, epochs=1, batch_size=4, lr=0.1, momentum=0.5,"
            " proximal_mu=0.1, seed=0)\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:1])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
