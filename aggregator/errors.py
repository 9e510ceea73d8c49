"""The errors of the aggregator package (derived from :class:`core.errors.QuorumError`)."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["ResumeRefused"]


class ResumeRefused(QuorumError):
    """A run cannot be continued as asked (another scenario, a round it lacks); the run is left as it was."""
