"""Fixtures for the DP tests."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: tests are reproducible (production passes ``secure_rng()``)."""
    return np.random.default_rng(20240607)
