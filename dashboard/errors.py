"""Errors raised by the dashboard package."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["DashboardError", "InsecureBind", "OidcConfigError", "ProviderError", "LoginRefused"]


class DashboardError(QuorumError):
    """Base class for dashboard errors."""


class InsecureBind(DashboardError):
    """Binding beyond loopback without an access token."""


class OidcConfigError(DashboardError):
    """A bad ``--oidc-*`` setting (issuer, client id, public URL, the client secret's variable)."""


class ProviderError(DashboardError):
    """The identity provider could not be reached, or answered what OpenID Connect does not allow."""


class LoginRefused(DashboardError):
    """A login that must not succeed: the provider refused the code, or its ID token failed a check.

    ``reason`` is a short fixed phrase for the audit trail (``"wrong audience"``),
    the message a sentence for the person logging in.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
