"""Errors of the ``quorum`` package (the CLI, export and serve)."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["ExportError"]


class ExportError(QuorumError):
    """An export cannot be written or loaded; the message names the run, round or file and why."""
