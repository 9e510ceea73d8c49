"""Errors raised by the dashboard package."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["DashboardError", "InsecureBind"]


class DashboardError(QuorumError):
    """Base class for dashboard errors."""


class InsecureBind(DashboardError):
    """Binding beyond loopback without an access token."""
