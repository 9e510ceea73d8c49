"""The errors of the aggregator package (derived from :class:`core.errors.QuorumError`)."""

from __future__ import annotations

from core.errors import QuorumError

__all__ = ["ResumeRefused", "AppModelError", "RunFailed", "TooFewClients"]


class ResumeRefused(QuorumError):
    """A run cannot be continued as asked (another scenario, a round it lacks); the run is left as it was."""


class AppModelError(QuorumError):
    """A Flower app's initial model could not be found (``aggregator.app_model``).

    The message says where it was looked for and how to name it.
    """


class RunFailed(QuorumError):
    """A run ended ``failed``.

    Raised by the ServerApp under ``flwr run``, so Flower records the run as
    failed (its log has the reason).
    """


class TooFewClients(QuorumError):
    """Fewer clients than a run needs connected in the time it waits for them (``wait_for_nodes``)."""
