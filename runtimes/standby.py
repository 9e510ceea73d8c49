"""``quorum simulate --resume-on-failure``: of several processes started for one run, one drives it; another takes over.

Two (or more) ``quorum simulate SCENARIO --resume-on-failure`` processes on
one PostgreSQL run store, on one host or several, share one run: the
scenario's *failover key* (a SHA-256 of the scenario as it was loaded, seed
and rounds included) names a PostgreSQL advisory lock (``runstore/leader.py``)
and is recorded in the run's ``info``. The process that holds the lock
drives the run; the others wait for the lock. PostgreSQL releases it when the
driver's connection ends, so a driver that is killed or loses its machine
lets a standby in within half a second, with no lease to wait out. The
standby takes the run (``runstore/takeover.py``: a driver that lost only its
connection is fenced out of every later write) and resumes it from its last
committed round, with a ``failover`` event. A standby whose driver ended the
run reports that run and exits with its code; a driver that died before it
stored a run leaves the standby to start it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from core.errors import StoreError
from core.status import ENDED, RunStatus
from runstore.leader import Leadership, supports_leadership
from runstore.store import Run, RunStore
from runstore.takeover import TakenRunStore
from runtimes.simulation import RunSummary, simulate, summarize
from scenarios.schema import Scenario

__all__ = ["failover_key", "simulate_with_failover", "KEY_INFO"]

#: Where a run records its failover key (``Run.info``).
KEY_INFO = "failover_key"
_POLL_S = 0.5


def failover_key(scenario: Scenario) -> str:
    """Return the key that makes processes started with ``scenario`` one group: 16 hex digits of its SHA-256.

    Where the scenario was read from is left out (``task.path`` is absolute, ``task.source`` the path as
    typed): two hosts, or two working directories, with the same scenario are one group.
    """
    record = scenario.to_dict()
    task = record.get("task")
    if isinstance(task, dict):
        record["task"] = {k: v for k, v in task.items() if k not in ("path", "source")}
    text = json.dumps(record, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def simulate_with_failover(scenario: Scenario, *, db_url: str, say: Callable[[str], None],
                           on_start: Callable[[str], None] | None = None,
                           stop: threading.Event | None = None, **options: Any) -> RunSummary | None:
    """Drive the run of ``scenario``, or stand by and take it over when its driver dies; summarise it.

    ``options`` go to :func:`runtimes.simulation.simulate`; ``say`` hears
    who drives while this process waits, and the take-over. ``None`` when
    ``stop`` was set while this process waited.

    Raises
    ------
    StoreError
        The store is not a PostgreSQL store (no lock to share), or cannot be reached.
    """
    if not supports_leadership(db_url):
        raise StoreError(f"--resume-on-failure needs a PostgreSQL run store that every process shares (--db "
                         f"postgresql+psycopg://USER@HOST/DB); this one is {db_url.split(':', 1)[0]}")
    key, started = failover_key(scenario), time.monotonic()
    who = f"{socket.gethostname()} pid {os.getpid()}"
    lead = Leadership(db_url, f"simulate:{key}", who=who)
    try:
        waited = _wait_for_lead(lead, db_url, key, say, stop or threading.Event())
        if waited is None:
            return None
        with TakenRunStore(db_url) as store:
            run = _run_of(store, key, since=waited.since) if waited.run_id is None else store.get_run(waited.run_id)
            if run is not None and run.status in ENDED | {RunStatus.FAILED}:
                return summarize(store, run.id, time.monotonic() - started)  # its driver ended it
            if run is not None:
                _take_over(store, run, who, say)
                return simulate(scenario, db_url=db_url, resume_id=run.id, holder=store.holder,
                                on_start=on_start, **options)
        return simulate(scenario, db_url=db_url, on_start=_keyed(db_url, key, on_start), **options)
    finally:
        lead.release()


@dataclass(frozen=True)
class _Waited:
    """How the wait for the lock went: since when (epoch seconds), and the run seen meanwhile (``None``: none)."""

    since: float
    run_id: str | None = None


def _wait_for_lead(lead: Leadership, db_url: str, key: str, say: Callable[[str], None],
                   stop: threading.Event) -> _Waited | None:
    """Take the lock, waiting while another process holds it; ``None`` when ``stop`` was set first."""
    since = time.time()
    if lead.try_acquire():
        return _Waited(since)
    watched: str | None = None
    told = ""
    with RunStore(db_url) as store:
        while not _acquired(lead):
            if stop.wait(_POLL_S):
                return None
            try:
                if watched is None:
                    run = _run_of(store, key, since=since)
                    watched = run.id if run is not None else None
                news = (f"standby: {lead.holder() or 'another process'} drives "
                        f"{'run ' + watched if watched else 'this scenario'}; it is taken over if that process dies")
            except (StoreError, SQLAlchemyError) as exc:  # the database restarting: the standby outlives it
                news = f"standby: the run store cannot be read ({str(exc).splitlines()[0][:200]}); trying again"
            if news != told:
                say(news)
                told = news
    return _Waited(since, watched)


def _acquired(lead: Leadership) -> bool:
    """Try the lock once; a database that cannot be reached is a lock not taken (tried again next poll)."""
    try:
        return lead.try_acquire()
    except StoreError:
        return False


def _run_of(store: RunStore, key: str, since: float) -> Run | None:
    """Return the newest run of this failover key: one that has not ended, or that ended after ``since``."""
    for run in store.list_runs():  # newest first
        if (run.info or {}).get(KEY_INFO) == key:
            ended = run.status in ENDED | {RunStatus.FAILED}
            return run if not ended or (run.updated_at or 0.0) >= since else None
    return None


def _take_over(store: TakenRunStore, run: Run, who: str, say: Callable[[str], None]) -> None:
    """Take ``run`` (its driver is gone: the lock says so) and log the failover."""
    store.take(run.id)
    done = store.get_run(run.id).rounds_done
    message = f"failover: {who} took over after round {done} (the process that drove the run stopped)"
    store.log(run.id, message, "warning")
    say(message)


def _keyed(db_url: str, key: str, on_start: Callable[[str], None] | None) -> Callable[[str], None]:
    """``on_start``, after recording the failover key in the new run's ``info``."""
    def started(run_id: str) -> None:
        with RunStore(db_url) as store:
            store.update_info(run_id, **{KEY_INFO: key})
        if on_start is not None:
            on_start(run_id)

    return started
