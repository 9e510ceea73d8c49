"""The two ways the ranks synchronise (kept apart so the CLI imports no torch)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Mode"]


class Mode(StrEnum):
    """How the ranks synchronise."""

    SYNC = "sync"          # gradients averaged every step
    LOCALSGD = "localsgd"  # local epochs (or steps), then models averaged and the strategy applied
