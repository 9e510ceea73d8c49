"""Model shapes and sizes, the flat-buffer view, and seeded construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learning.models import build_model, get_flat, num_params, set_flat

MNIST, DIGITS, SYNTHETIC = (1, 28, 28), (1, 8, 8), (60,)

# Sizes by hand (weights + biases):
#   logreg on MNIST: 784*10 + 10 = 7,850
#   mlp on MNIST (McMahan's 2NN): 784*200+200 + 200*200+200 + 200*10+10 = 199,210
#   cnn on MNIST: conv 1*16*25+16 = 416; conv 16*32*25+32 = 12,832;
#                 fc 32*7*7*64+64 = 100,416; fc 64*10+10 = 650   -> 114,314
#   cnn on digits: fc 32*2*2*64+64 = 8,256                       -> 22,154
#   mlp on digits: 64*200+200 + 40,200 + 2,010 = 55,210
#   logreg on synthetic: 60*10 + 10 = 610; mlp: 60*200+200 + 40,200 + 2,010 = 54,410
SIZES = [
    ("logreg", MNIST, 7850), ("mlp", MNIST, 199210), ("cnn", MNIST, 114314),
    ("logreg", DIGITS, 650), ("mlp", DIGITS, 55210), ("cnn", DIGITS, 22154),
    ("logreg", SYNTHETIC, 610), ("mlp", SYNTHETIC, 54410),
]


@pytest.mark.parametrize(("name", "shape", "size"), SIZES)
def test_output_shape_and_size(name: str, shape: tuple[int, ...], size: int) -> None:
    model = build_model(name, shape, 10, seed=0)
    out = model(torch.zeros((5, *shape)))
    assert out.shape == (5, 10)
    assert num_params(model) == size == get_flat(model).shape[0]


def test_cnn_needs_an_image() -> None:
    with pytest.raises(ValueError, match=r"cnn needs an image input .* got \(60,\)"):
        build_model("cnn", SYNTHETIC, 10)
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        build_model("resnet", MNIST, 10)


def test_flat_is_state_dict_order() -> None:
    model = build_model("logreg", (3,), 2, seed=1)
    weight, bias = model.state_dict().values()
    expected = np.concatenate([weight.numpy().ravel(), bias.numpy()])
    flat = get_flat(model)
    assert flat.dtype == np.float32 and flat.flags.c_contiguous
    np.testing.assert_array_equal(flat, expected)


def test_set_flat_roundtrip_and_independence() -> None:
    model = build_model("cnn", DIGITS, 10, seed=0)
    target = np.arange(22154, dtype=np.float32) / 1000.0
    target.flags.writeable = False  # as a buffer received from the network might be
    set_flat(model, target)
    np.testing.assert_array_equal(get_flat(model), target)
    out = get_flat(model)
    out[:] = 0.0  # a copy: changing it leaves the model alone
    np.testing.assert_array_equal(get_flat(model), target)


def test_set_flat_names_both_sizes() -> None:
    model = build_model("logreg", (3,), 2)
    with pytest.raises(ValueError, match=r"shape \(7,\); expected 8 values"):
        set_flat(model, np.zeros(7, np.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 4\); expected 8 values"):
        set_flat(model, np.zeros((2, 4), np.float32))


def test_seeded_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = get_flat(build_model("mlp", DIGITS, 10, seed=5))
    b = get_flat(build_model("mlp", DIGITS, 10, seed=5))
    c = get_flat(build_model("mlp", DIGITS, 10, seed=6))
    assert torch.equal(torch.get_rng_state(), before)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
