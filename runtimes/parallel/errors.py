"""Errors of the data-parallel mode, in one flat module."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["ParallelError", "WorkerLost", "WorkerStopped", "LaunchFailed"]


class ParallelError(QuorumError):
    """The data-parallel job cannot start or cannot go on; the message says why."""


class WorkerLost(ParallelError):
    """A collective failed or timed out: another worker died, hung or left the job."""


class WorkerStopped(ParallelError):
    """The worker was told to stop (SIGTERM/SIGINT), usually because another one failed."""


class LaunchFailed(ParallelError):
    """The launcher saw workers fail; the message names each rank, pid and exit status."""
