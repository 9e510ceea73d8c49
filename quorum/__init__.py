"""Quorum: federated learning with secure aggregation, differential privacy and a live dashboard.

``quorum.load_model(DIR)`` returns the torch module of a model written by
``quorum export`` (see :mod:`quorum.export`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_model"]


def __getattr__(name: str) -> Any:
    # resolved on first use: `import quorum` (and so the CLI's start-up) stays free of torch
    if name == "load_model":
        from quorum.export import load_model

        return load_model
    raise AttributeError(f"module 'quorum' has no attribute {name!r}")
