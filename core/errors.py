"""The error base, and the errors of the core layer, in one flat module.

Every error Quorum raises on purpose derives from :class:`QuorumError`; each
package keeps its own in one flat ``errors.py`` and derives them from here:

- ``core``: :class:`UpdateRejected`, :class:`RunNotFound`, :class:`StoreError`;
- ``scenarios.errors.ScenarioError``; ``learning.errors.DataError``; ``aggregator.errors.ResumeRefused``;
- ``privacy.dp.errors.DPError`` and ``privacy.secagg.errors.SecAggError`` (with their subclasses);
- ``runtimes.parallel.errors.ParallelError``; ``deploy.errors.DeployError``;
  ``dashboard.errors.DashboardError``.

A client that drops out is data, not an error.
"""

from __future__ import annotations

__all__ = ["QuorumError", "UpdateRejected", "RunNotFound", "StoreError", "EdgeUnavailable"]


class QuorumError(Exception):
    """Base class of every error Quorum raises on purpose (see the module docstring for the list)."""


class UpdateRejected(QuorumError):
    """A client update failed validation; the reason is the message."""


class RunNotFound(QuorumError):
    """No run with the given id exists in the run store."""


class StoreError(QuorumError):
    """The run store is unusable (wrong schema, unreadable checkpoint)."""


class EdgeUnavailable(QuorumError):
    """An edge aggregator's ServerApp did not answer its upstream ClientApp in time (``core.channel``)."""
