"""Model definitions shared by clients and aggregator, and the flat-buffer view of a model.

A model travels and is aggregated as one contiguous 1-D float32 buffer holding
every tensor of ``model.state_dict()`` in order (:func:`get_flat`,
:func:`set_flat`). Models are built deterministically from a seed without
touching the caller's global torch RNG.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from core.layouts import ParamLayout

__all__ = ["MODEL_NAMES", "layout_of", "build_model", "get_flat", "set_flat", "num_params", "trainable_names",
           "num_trainable", "get_trainable_flat", "set_trainable_flat"]

MODEL_NAMES = ("logreg", "mlp", "cnn")


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, *, seed: int = 0
) -> nn.Module:
    """Build a freshly initialised model.

    Parameters
    ----------
    name : {"logreg", "mlp", "cnn"}
        ``logreg``: multinomial logistic regression (flatten, linear).
        ``mlp``: McMahan et al.'s "2NN", two hidden layers of 200 ReLU units
        (784-200-200-10 on MNIST).
        ``cnn``: a small CNN in the spirit of McMahan et al.'s, narrowed so
        that it trains fast on a few CPU cores: conv5x5(16)-pool-conv5x5(32)-pool
        -fc(64)-fc(classes), "same" padding so 8x8 inputs work too. Needs an
        image input shape ``(C, H, W)`` with ``H, W >= 4``.
    input_shape : sequence of int
        Shape of one example, e.g. ``(1, 28, 28)`` or ``(60,)``.
    num_classes : int
        Number of output logits.
    seed : int
        Seed of the initialisation; the global torch RNG is left as it was.

    References
    ----------
    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017, section 3.
    """
    shape = tuple(int(d) for d in input_shape)
    if num_classes < 2 or not shape or min(shape) < 1:
        raise ValueError(f"need num_classes >= 2 and a positive input shape, got {num_classes} and {shape}")
    builders = {"logreg": _logreg, "mlp": _mlp, "cnn": _cnn}
    if name not in builders:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODEL_NAMES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(operator.index(seed))
        return builders[name](shape, num_classes)


def _logreg(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), num_classes))


def _mlp(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(shape), 200), nn.ReLU(),
        nn.Linear(200, 200), nn.ReLU(),
        nn.Linear(200, num_classes),
    )


def _cnn(shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(shape) != 3 or min(shape[1:]) < 4:
        raise ValueError(f"the cnn needs an image input (C, H, W) with H, W >= 4, got {shape}")
    channels, height, width = shape
    return nn.Sequential(
        nn.Conv2d(channels, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * (height // 4) * (width // 4), 64), nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def num_params(model: nn.Module) -> int:
    """Count the scalars in ``model.state_dict()``: the length of :func:`get_flat`."""
    return sum(t.numel() for t in model.state_dict().values())


def get_flat(model: nn.Module) -> np.ndarray:
    """Return every tensor of ``model.state_dict()``, in order, as one new 1-D float32 array."""
    tensors = [t.detach().reshape(-1).to(torch.float32) for t in model.state_dict().values()]
    if not tensors:
        return np.zeros(0, dtype=np.float32)
    return torch.cat(tensors).numpy()


def set_flat(model: nn.Module, flat: np.ndarray) -> None:
    """Load a buffer made by :func:`get_flat` into ``model``, in place.

    Raises
    ------
    ValueError
        ``flat`` is not 1-D or its size differs from :func:`num_params`; the
        message gives the expected and the received sizes.
    """
    flat = np.asarray(flat)
    expected = num_params(model)
    if flat.ndim != 1 or flat.size != expected:
        raise ValueError(f"flat buffer has shape {flat.shape}; expected {expected} values (1-D)")
    source = torch.from_numpy(np.array(flat, dtype=np.float32))  # own, writable copy
    offset = 0
    with torch.no_grad():
        for tensor in model.state_dict().values():
            n = tensor.numel()
            tensor.copy_(source[offset:offset + n].view_as(tensor))
            offset += n


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters that train (``requires_grad``), in ``state_dict`` order.

    These travel and are aggregated; frozen parameters and buffers (batch-norm
    statistics) stay on the device. For a model whose every tensor is a
    trainable parameter, :func:`get_trainable_flat` equals :func:`get_flat`.
    """
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return [name for name in model.state_dict(keep_vars=True) if name in trainable]


def _selected(model: nn.Module, names: Sequence[str] | None) -> list[torch.Tensor]:
    state = model.state_dict()
    chosen = trainable_names(model) if names is None else list(names)
    missing = [name for name in chosen if name not in state]
    if missing:
        raise ValueError(f"the model has no tensor named {missing[0]!r}")
    return [state[name] for name in chosen]


def num_trainable(model: nn.Module, names: Sequence[str] | None = None) -> int:
    """Count the scalars that travel: the length of :func:`get_trainable_flat`."""
    return sum(t.numel() for t in _selected(model, names))


def get_trainable_flat(model: nn.Module, names: Sequence[str] | None = None) -> np.ndarray:
    """Return the tensors ``names`` (default :func:`trainable_names`), in order, as one new 1-D float32 array."""
    tensors = [t.detach().reshape(-1).to(torch.float32) for t in _selected(model, names)]
    if not tensors:
        return np.zeros(0, dtype=np.float32)
    return torch.cat(tensors).numpy()


def set_trainable_flat(model: nn.Module, flat: np.ndarray, names: Sequence[str] | None = None) -> None:
    """Load a buffer made by :func:`get_trainable_flat` into ``model``, in place; other tensors keep their values.

    Raises
    ------
    ValueError
        ``flat`` is not 1-D or its size differs from :func:`num_trainable`.
    """
    flat = np.asarray(flat)
    tensors = _selected(model, names)
    expected = sum(t.numel() for t in tensors)
    if flat.ndim != 1 or flat.size != expected:
        raise ValueError(f"flat buffer has shape {flat.shape}; expected {expected} trainable values (1-D)")
    source = torch.from_numpy(np.array(flat, dtype=np.float32))  # own, writable copy
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            n = tensor.numel()
            tensor.copy_(source[offset:offset + n].view_as(tensor))
            offset += n


def layout_of(model: nn.Module, names: Sequence[str] | None = None) -> ParamLayout:
    """Return the names and shapes of the tensors that travel (default :func:`trainable_names`), in buffer order.

    This is how the global model is laid out on the wire, as a ``state_dict`` a
    stock Flower client loads.
    """
    state = model.state_dict()
    return ParamLayout.of({name: tuple(state[name].shape) for name in (trainable_names(model) if names is None
                                                                          else names)})
