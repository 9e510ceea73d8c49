"""Errors of the site-policy package, in one flat module."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["PolicyError"]


class PolicyError(QuorumError, ValueError):
    """A site policy (or the device's round count) cannot be used; the one-line message names the key and value."""
