"""Which aggregator of a federation leads: a PostgreSQL advisory lock, held for as long as its connection lives.

Two aggregator hosts (or two on one host) share one PostgreSQL run store; the
one that holds the federation's lock runs the SuperLink and its runs, the
other (``quorum aggregator start --standby``) waits for it. PostgreSQL
releases a session's advisory locks when its connection ends, so a leader
that is killed, loses power or is cut off from the database lets the standby
in within a poll, with no lease to wait out. The leader checks its own
connection every few seconds (:meth:`Leadership.alive`): once it is gone, so
is the lock, and the leader stops its SuperLink rather than run beside the
new one (the run store's holder fence, ``runstore/takeover.py``, refuses its
ServerApp's writes in any case).

The lock's key is derived from the federation's name, so two federations on
one database never block each other; the holder's connection carries an
``application_name`` naming its host and pid, which is what a refused start
or a waiting standby reports.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import socket
import threading
import weakref
from collections.abc import Callable

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import NullPool

from core.errors import StoreError

__all__ = ["Leadership", "lock_key", "supports_leadership"]

_PREFIX = "quorum-aggregator:"
#: How long one check of the leader's connection may take before the leader counts it as lost.
CHECK_TIMEOUT_S = 5


def supports_leadership(url: str) -> bool:
    """Whether the run store at ``url`` can hold a leadership lock (PostgreSQL only)."""
    return url.startswith(("postgresql", "postgres://"))


def lock_key(federation: str) -> int:
    """Return the advisory lock key of ``federation``: 8 bytes of a SHA-256 of its name, as a signed bigint."""
    digest = hashlib.sha256((_PREFIX + federation).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class Leadership:
    """One aggregator's claim on leading the federation ``name`` of the PostgreSQL store at ``url``.

    ``who`` names this aggregator for the other one's messages (default:
    host name and pid). The lock lives on a connection of its own, outside
    any pool; :meth:`release` (or this process's death) gives it up.
    """

    def __init__(self, url: str, name: str, who: str | None = None) -> None:
        if not supports_leadership(url):
            raise StoreError("an aggregator standby needs a PostgreSQL run store shared by both aggregators "
                             "(aggregator.database = \"postgresql+psycopg://USER@HOST/DB\"); this store is "
                             f"{url.split(':', 1)[0]}")
        self.key, self.name = lock_key(name), name
        self.who = who or f"{socket.gethostname()} pid {os.getpid()}"
        # keep-alives end a connection to a vanished server in seconds, not the kernel's two hours
        self._engine: Engine = create_engine(url, poolclass=NullPool, connect_args={
            "application_name": f"quorum aggregator {self.who}"[:63], "connect_timeout": CHECK_TIMEOUT_S,
            "keepalives": 1, "keepalives_idle": 2, "keepalives_interval": 1, "keepalives_count": 3})
        self._conn: Connection | None = None
        self.held = False
        os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))

    def _forget_in_child(self) -> None:
        """In a forked child (a worker pool): drop the lock's connection without a word to the server.

        The child's copy of its socket would keep the session, and so the lock,
        alive after this process died, for as long as the child lives. The
        socket is replaced by ``/dev/null`` in the child alone; the parent's
        connection is untouched, and the child never leads.
        """
        conn, self._conn, self.held = self._conn, None, False
        if conn is None:
            return
        try:
            fd = conn.connection.dbapi_connection.fileno()  # type: ignore[union-attr]
        except (AttributeError, SQLAlchemyError, OSError):
            return
        null = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            self._conn.execute(text(f"SET statement_timeout = {CHECK_TIMEOUT_S * 1000}"))
        return self._conn

    def _drop(self) -> None:
        conn, self._conn, self.held = self._conn, None, False
        if conn is not None:
            try:
                conn.close()
            except SQLAlchemyError:
                conn.invalidate()

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; whether this aggregator leads now.

        Raises
        ------
        StoreError
            The database cannot be reached.
        """
        if self.held:
            return True
        try:
            got = self._connection().execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": self.key}).scalar()
        except SQLAlchemyError as exc:
            self._drop()
            raise StoreError(f"cannot reach the run store to take the aggregator lock: {_reason(exc)}") from None
        self.held = bool(got)
        return self.held

    def wait(self, stop: threading.Event, poll_s: float = 0.5,
             say: Callable[[str], None] | None = None) -> bool:
        """Poll until this aggregator takes the lock (True) or ``stop`` is set (False).

        ``say`` hears who leads while this one waits, and about a database
        that cannot be reached (polled again: the standby outlives an outage).
        """
        told: str | None = None
        while not stop.is_set():
            try:
                if self.try_acquire():
                    return True
                news = f"standby: {self.holder() or 'another aggregator'} leads federation {self.name!r}; waiting"
            except StoreError as exc:
                news = f"standby: {exc}; trying again"
            if say is not None and news != told:
                say(news)
            told = news
            stop.wait(poll_s)
        return False

    def holder(self) -> str | None:
        """Who holds the lock now (its connection's ``application_name`` and address), or ``None``."""
        hi, lo = (self.key >> 32) & 0xFFFF_FFFF, self.key & 0xFFFF_FFFF
        try:
            row = self._connection().execute(text(
                "SELECT a.application_name, host(a.client_addr) FROM pg_locks l "
                "JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted "
                "AND l.classid::bigint = :hi AND l.objid::bigint = :lo AND l.objsubid = 1"),
                {"hi": hi, "lo": lo}).first()
        except SQLAlchemyError:
            self._drop()
            return None
        if row is None:
            return None
        name = str(row[0] or "an unnamed connection").removeprefix("quorum aggregator ")
        return f"{name} (from {row[1]})" if row[1] else name

    def alive(self) -> bool:
        """Whether this aggregator still holds the lock: its connection answers and still has it.

        False once the connection died (the server restarted, the network
        failed, an administrator ended it): PostgreSQL has released the lock
        and the standby may lead already.
        """
        if not self.held:
            return False
        try:
            mine = self._connection().execute(text(
                "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory' "
                "AND granted AND classid::bigint = :hi AND objid::bigint = :lo AND objsubid = 1"),
                {"hi": (self.key >> 32) & 0xFFFF_FFFF, "lo": self.key & 0xFFFF_FFFF}).scalar()
        except SQLAlchemyError:
            self._drop()
            return False
        if not mine:
            self._drop()
        return bool(mine)

    def release(self) -> None:
        """Give up the lock (if held) and close its connection."""
        if self.held and self._conn is not None:
            with contextlib.suppress(SQLAlchemyError):
                self._conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
        self._drop()
        self._engine.dispose()


def _forget_in_child(lead: weakref.ref[Leadership]) -> None:
    """After a fork, in the child: what :meth:`Leadership._forget_in_child` says, if that claim still exists."""
    found = lead()
    if found is not None:
        found._forget_in_child()


def _reason(exc: SQLAlchemyError) -> str:
    orig = getattr(exc, "orig", None)
    return str(orig or exc).strip().splitlines()[0][:300]
