"""One driver per run: a run store whose writes to a run need it to hold that run.

An aggregator killed mid-run leaves a ServerApp that takes a moment to notice;
the restarted one takes the run, and the old one can no longer commit a round,
renew the lease or change the run's status, so no round is ever counted twice.
The run's ``holder`` column names its driver; every write of a driver checks it
in the write's own transaction, whose first statement (an UPDATE guarded by
the holder) locks the run's row on PostgreSQL and the database on SQLite, so
a take-over in flight is waited for, never overwritten (``tests/runstore/test_postgres_store.py``
interleaves the two on a real PostgreSQL). (The lease of ``runstore/lease.py``
is the other half: how a reader tells that a run's driver died.)
"""

from __future__ import annotations

import os
import uuid

from sqlalchemy import update

from core.errors import RunNotFound
from runstore.store import LeaseLost, Run, RunStore

__all__ = ["TakenRunStore", "LeaseLost"]


class TakenRunStore(RunStore):
    """A run store that writes only the runs this process took.

    ``take(run_id)`` makes this process the run's holder; commits, renewals and
    status changes of any other process's store with a holder are refused
    (:class:`~runstore.store.LeaseLost`) from then on.
    """

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.holder = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def take(self, run_id: str) -> None:
        """Make this process the run's only writer (whoever held it before)."""
        with self.session() as s, s.begin():
            done = s.execute(update(Run).where(Run.id == run_id).values(holder=self.holder))
            if done.rowcount != 1:  # type: ignore[attr-defined]
                raise RunNotFound(f"no run {run_id!r} in {self.url}")
