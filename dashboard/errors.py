"""Errors raised by the dashboard package."""

from __future__ import annotations

__all__ = ["DashboardError", "InsecureBind"]


class DashboardError(Exception):
    """Base class for dashboard errors."""


class InsecureBind(DashboardError):
    """Binding beyond loopback without an access token."""
