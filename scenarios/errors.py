"""Errors of the scenario package."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["ScenarioError"]


class ScenarioError(QuorumError, ValueError):
    """A scenario file is malformed: the message names the file, key and value."""
