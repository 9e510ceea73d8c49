"""Fixtures for the DP tests."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: tests are reproducible (production passes ``secure_rng()``)."""
    return np.random.default_rng(20240607)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models: threads only contend (the callers of train_dp_sgd choose their own)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
