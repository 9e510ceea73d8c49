"""Errors of the client side, in one flat module."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["DataError", "TaskError"]


class DataError(QuorumError, ValueError):
    """A data file is unusable; the one-line message names the file and the problem."""


class TaskError(QuorumError, ValueError):
    """A task cannot be loaded or used; the one-line message names the entry, the key or the method."""
