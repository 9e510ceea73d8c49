"""Errors of the client side, in one flat module."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["DataError"]


class DataError(QuorumError, ValueError):
    """A data file is unusable; the one-line message names the file and the problem."""
