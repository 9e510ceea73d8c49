"""One driver per run: a run store whose writes to a run need the token of the process that took it last.

An aggregator killed mid-run leaves a ServerApp that takes a moment to notice;
the restarted one takes the run, and the old one can no longer commit a round
or change the run's status, so no round is ever counted twice. (The lease of
``runstore/lease.py`` is the other half: how a reader tells that a run's
driver died.)
"""

from __future__ import annotations

import os
import uuid

from core.errors import StoreError
from core.records import RoundRecord
from core.strategy import ServerState
from runstore.store import RunStore

__all__ = ["TakenRunStore", "LeaseLost"]


class LeaseLost(StoreError):
    """Another process took over this run; this one must stop writing."""


class TakenRunStore(RunStore):
    """A run store whose writes to one run need that run's token.

    ``take(run_id)`` writes this process's token into the run's info; commits
    and status changes check it first, so of two processes driving one run only
    the one that took it last can write.
    """

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def take(self, run_id: str) -> None:
        """Make this process the run's only writer."""
        self.update_info(run_id, lease=self.token)

    def _check(self, run_id: str) -> None:
        holder = (self.get_run(run_id).info or {}).get("lease")
        if holder not in (None, self.token):
            raise LeaseLost(f"run {run_id} is now driven by ServerApp {holder}; this one ({self.token}) stops")

    def commit_round(self, run_id: str, record: RoundRecord, state: ServerState) -> None:
        """Commit the round if this process still holds the run (else :class:`LeaseLost`)."""
        self._check(run_id)
        super().commit_round(run_id, record, state)

    def set_status(self, run_id: str, status: str, error: str | None = None) -> None:
        """Set the run's status if this process still holds the run (else :class:`LeaseLost`)."""
        self._check(run_id)
        super().set_status(run_id, status, error)
