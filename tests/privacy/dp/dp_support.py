"""Helpers shared by the DP-SGD tests."""

from __future__ import annotations

import numpy as np

from learning.datasets import ArrayDataset

__all__ = ["blobs"]


def blobs(n: int, rng: np.random.Generator) -> ArrayDataset:
    """Two well-separated Gaussian classes in 10 dimensions."""
    y = rng.integers(0, 2, n)
    x = rng.standard_normal((n, 10)) + np.where(y[:, None] == 1, 1.5, -1.5)
    return ArrayDataset(x.astype(np.float32), y.astype(np.int64))
