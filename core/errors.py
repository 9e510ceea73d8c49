"""Errors of the aggregator side, in one flat module."""

from __future__ import annotations

__all__ = ["QuorumError", "UpdateRejected", "RunNotFound", "StoreError"]


class QuorumError(Exception):
    """Base class of every error Quorum raises on purpose."""


class UpdateRejected(QuorumError):
    """A client update failed validation; the reason is the message."""


class RunNotFound(QuorumError):
    """No run with the given id exists in the run store."""


class StoreError(QuorumError):
    """The run store is unusable (wrong schema, unreadable checkpoint)."""
