"""Errors of the deployment runtime, in one flat module."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["DeployError", "ConfigError", "EnrollError", "ProcessFailed"]


class DeployError(QuorumError):
    """Base class: a federation could not be set up or driven."""


class ConfigError(DeployError):
    """``federation.toml`` holds an unknown key or a bad value (named in the message)."""


class EnrollError(DeployError):
    """A device could not be enrolled or revoked."""


class ProcessFailed(DeployError):
    """A process the deployment depends on exited or never became ready."""
