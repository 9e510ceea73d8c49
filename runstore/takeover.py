"""One driver per run: a run store whose writes to a run need it to hold that run.

An aggregator killed mid-run leaves a ServerApp that takes a moment to notice;
the restarted one takes the run, and the old one can no longer commit a round,
log, renew the lease or change the run's status, so no round is ever counted twice.
The run's ``holder`` column names its driver; every write of a driver checks it
in the write's own transaction, whose first statement (an UPDATE guarded by
the holder) locks the run's row on PostgreSQL and the database on SQLite, so
a take-over in flight is waited for, never overwritten (``tests/runstore/test_postgres_store.py``
interleaves the two on a real PostgreSQL). (The lease of ``runstore/lease.py``
is the other half: how a reader tells that a run's driver died.)

Two ways to take a run: a deployment's restarted ServerApp takes its run
whoever held it (:meth:`TakenRunStore.take`: the old ServerApp may live on a
while, and must stop); ``quorum simulate`` takes the run it creates, and
``quorum resume`` claims a run only while no live process drives it
(:meth:`TakenRunStore.claim`), so of two resumes of one run the second is
refused before it writes a line.
"""

from __future__ import annotations

import os
import time
import uuid

from sqlalchemy import or_, update

from core.errors import RunNotFound, StoreError
from runstore.lease import lease_seconds
from runstore.store import LeaseLost, Run, RunStore

__all__ = ["TakenRunStore", "LeaseLost", "RunHeld"]


class RunHeld(StoreError):
    """A live process drives the run (its lease has not expired): :meth:`TakenRunStore.claim` left it alone."""

    def __init__(self, run_id: str, holder: str | None, lease_until: float | None) -> None:
        self.run_id, self.holder = run_id, holder
        until = "an unknown time" if lease_until is None else time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(lease_until))
        super().__init__(f"run {run_id} is being driven by {holder or 'another process'} (lease until {until}); "
                         "resume it when that process stopped")


class TakenRunStore(RunStore):
    """A run store that writes only the runs this process took.

    ``take(run_id)`` or ``claim(run_id)`` makes this process the run's holder;
    commits, logs, renewals and status changes of any other process's store
    with a holder are refused (:class:`~runstore.store.LeaseLost`) from then on.
    ``holder`` names this process (default: its pid and a random tag); a
    second store given the same name writes for the same holder.
    """

    def __init__(self, url: str, holder: str | None = None) -> None:
        super().__init__(url)
        self.holder = holder or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def take(self, run_id: str) -> None:
        """Make this process the run's only writer (whoever held it before)."""
        with self.session() as s, s.begin():
            done = s.execute(update(Run).where(Run.id == run_id).values(holder=self.holder))
            if done.rowcount != 1:  # type: ignore[attr-defined]
                raise RunNotFound(f"no run {run_id!r} in {self.url}")

    def claim(self, run_id: str) -> None:
        """Take the run unless a live process drives it, with a fresh lease, in one conditional UPDATE.

        A run is free when its lease has expired (its process was killed), or
        it has none (it stopped: interrupted, failed; or a Quorum before the
        lease wrote it), or this store holds it already. The UPDATE is the
        transaction's one write, so of two claims at once the second sees the
        first one's lease and is refused. The run's status is left as it is:
        its driver sets it when it starts.

        Raises
        ------
        RunHeld
            Another live process drives the run; nothing was written.
        RunNotFound
            No run ``run_id``.
        """
        now = self.clock()
        free = or_(Run.lease_until.is_(None), Run.lease_until <= now, Run.holder == self.holder)
        with self.session() as s, s.begin():
            done = s.execute(update(Run).where(Run.id == run_id, free)
                             .values(holder=self.holder, heartbeat_at=now, lease_until=now + lease_seconds()))
            if done.rowcount == 1:  # type: ignore[attr-defined]
                return
            run = s.get(Run, run_id)
            if run is None:
                raise RunNotFound(f"no run {run_id!r} in {self.url}")
            raise RunHeld(run.id, run.holder, run.lease_until)

    def release(self, run_id: str) -> None:
        """End the lease of a run this process holds, now: a run it claimed but never drove is free at once.

        A run another process took is left alone; one this process left
        ``running`` reads ``interrupted`` from now on.
        """
        now = self.clock()
        with self.session() as s, s.begin():
            s.execute(update(Run).where(Run.id == run_id, Run.holder == self.holder, Run.lease_until > now)
                      .values(lease_until=now))
