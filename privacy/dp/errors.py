"""Errors of the differential-privacy package, in one flat module."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["DPError", "DPConfigError", "DPStateError"]


class DPError(QuorumError):
    """Base class of every error ``privacy.dp`` raises on purpose."""


class DPConfigError(DPError, ValueError):
    """A DP setting is invalid; the message names the key and the value."""

    def __init__(self, key: str, value: object, why: str) -> None:
        super().__init__(f"{key} = {value!r}: {why}")
        self.key, self.value, self.why = key, value, why


class DPStateError(DPError):
    """The DP state carried in ``ServerState.wrapper_state['dp']`` is missing, foreign or inconsistent.

    The privacy spent can then no longer be accounted for.
    """
