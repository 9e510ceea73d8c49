"""The run store: runs, rounds, per-client results and events, over SQLAlchemy.

SQLite (a file, WAL mode so the dashboard reads while the aggregator writes) by
default, any SQLAlchemy URL for a shared deployment. Model checkpoints are
``safetensors`` blobs kept where ``runstore.checkpoints`` says (a folder beside
a SQLite store, the database itself for a server store, or an fsspec URL); a
round row, its client results and its checkpoint reference are committed in
one transaction, after a checkpoint file has been written and renamed into
place or with the checkpoint's own rows, so a crash leaves either the whole
round or none of it.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import numpy as np
from sqlalchemy import JSON, Float, ForeignKey, Integer, String, Text, insert, select, true
from sqlalchemy.orm import Mapped, Session, mapped_column
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.sql import ColumnElement, and_, or_, update

from core.errors import RunNotFound, StoreError
from core.headline import Headline, round_value
from core.records import ClientRecord, RoundRecord
from core.replies import MAX_EXAMPLES, clean_metrics
from core.status import ClientStatus, RunStatus
from core.strategy import ServerState
from runstore.accounts import AccountRow as _AccountRow  # noqa: F401  (its tables are part of the store's schema)
from runstore.audit import AuditLog as _AuditLog  # noqa: F401  (its table is part of the store's schema)
from runstore.base import Base
from runstore.blobs import Blob, checked_reference
from runstore.checkpoints import (
    Checkpoints,
    FolderCheckpoints,
    UrlCheckpoints,
    checkpoints_at,
    decode_state,
    encode_state,
    open_blob,
    read_blob,
)
from runstore.devices import DeviceRow as _DeviceRow  # noqa: F401  (its table is part of the store's schema)
from runstore.lease import INTERRUPTED, lease_expired, lease_seconds
from runstore.opening import open_engine
from runstore.store_url import default_db_url
from runstore.submissions import SubmissionRow as _SubmissionRow  # noqa: F401  (its table is part of the store's schema)

#: The environment variable naming where checkpoints go (``runstore.checkpoints.checkpoints_at``).
CHECKPOINTS_ENV = "QUORUM_CHECKPOINTS"

__all__ = ["CHECKPOINTS_ENV", "RunStore", "Run", "Round", "ClientResult", "Event", "RoundRecord", "ClientRecord",
           "LeaseLost", "default_db_url", "status_is", "as_shown"]


class LeaseLost(StoreError):
    """Another process took over this run; this one must stop writing."""


class Run(Base):
    """A run: its scenario, status, progress, lease and recorded ``info``."""

    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    scenario: Mapped[dict[str, Any]] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(32), index=True)
    engine: Mapped[str] = mapped_column(String(32), default="inprocess")
    strategy: Mapped[str] = mapped_column(String(64))
    rounds_total: Mapped[int] = mapped_column(Integer)
    rounds_done: Mapped[int] = mapped_column(Integer, default=0)
    num_params: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    info: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # The owner's lease (runstore/lease.py): when it last renewed ("last seen"), and until when
    # the run counts as alive; a running run past ``lease_until`` reads ``interrupted``.
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    lease_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    # The process that drives the run (runstore/takeover.py): only it may commit a round or change the status.
    holder: Mapped[str | None] = mapped_column(String(128), nullable=True)


class Round(Base):
    """A committed round of a run: its client counts, scores, bytes, privacy spent and checkpoint."""

    __tablename__ = "rounds"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[float] = mapped_column(Float)
    duration_s: Mapped[float] = mapped_column(Float)
    sampled: Mapped[int] = mapped_column(Integer)
    answered: Mapped[int] = mapped_column(Integer)
    dropped: Mapped[int] = mapped_column(Integer)
    rejected: Mapped[int] = mapped_column(Integer)
    failed: Mapped[int] = mapped_column(Integer, default=0)  # clients whose task raised (core/outcomes.py)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    fed_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    fed_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    server_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    server_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    bytes_in: Mapped[int] = mapped_column(Integer, default=0)
    bytes_out: Mapped[int] = mapped_column(Integer, default=0)
    epsilon: Mapped[float | None] = mapped_column(Float, nullable=True)
    secagg: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    tree: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # [hierarchy]: each edge's part
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    checkpoint: Mapped[str] = mapped_column(Text)
    # The value of the run's headline metric this round (core.headline: run.info["headline"], the server's
    # score first): what "best" and "last" mean for the run, in SQL, whatever the metric is called.
    headline: Mapped[float | None] = mapped_column(Float, nullable=True)


class ClientResult(Base):
    """One client's result in one round: its outcome (and reason), examples, scores and bytes."""

    __tablename__ = "client_results"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    round: Mapped[int] = mapped_column(Integer, index=True)
    client: Mapped[str] = mapped_column(String(64), index=True)
    outcome: Mapped[str] = mapped_column(String(32))
    stage: Mapped[str | None] = mapped_column(String(32), nullable=True)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    num_examples: Mapped[int] = mapped_column(Integer, default=0)
    train_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    eval_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    eval_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    duration_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    bytes_in: Mapped[int] = mapped_column(Integer, default=0)
    bytes_out: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    finished_at: Mapped[float] = mapped_column(Float)


class Event(Base):
    """A line of a run's log: its time, level and message."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    ts: Mapped[float] = mapped_column(Float)
    level: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)


def status_is(status: str, now: float) -> ColumnElement[bool]:
    """Select the runs that read ``status`` at ``now``.

    A running run whose lease expired reads ``interrupted``. Plain SQL that
    SQLite and PostgreSQL both run.
    """
    expired = and_(Run.status == RunStatus.RUNNING, Run.lease_until < now)
    if status == INTERRUPTED:
        return or_(Run.status == INTERRUPTED, expired)
    if status == RunStatus.RUNNING:
        return and_(Run.status == RunStatus.RUNNING, or_(Run.lease_until.is_(None), Run.lease_until >= now))
    return Run.status == status


def as_shown(run: Run, now: float) -> Run:
    """``run`` (read, detached) with the status a reader shows at ``now``; the row is not changed."""
    if lease_expired(run.status, run.lease_until, now):
        set_committed_value(run, "status", INTERRUPTED)
    return run


def _lock_row(s: Session, run_id: str, where: ColumnElement[bool]) -> None:
    """Lock the run's row for the rest of the transaction (if ``where`` holds for it), changing nothing."""
    s.execute(update(Run).where(Run.id == run_id, where).values(holder=Run.holder)
              .execution_options(synchronize_session=False))


class RunStore:
    """Read and write runs; checkpoints go where ``checkpoints`` says (:func:`runstore.checkpoints.checkpoints_at`).

    ``checkpoints`` defaults to ``$QUORUM_CHECKPOINTS`` (every process of a
    deployment reads it, as it reads ``$QUORUM_DB``), else the store's own
    default; ``checkpoint_dir`` is a folder for them (the same as
    ``checkpoints`` naming one). ``clock`` (seconds since the epoch) dates leases and decides which
    have expired: tests pass their own instead of waiting. ``holder``, when set, names the process this
    store writes for: it commits rounds, logs, renews leases and sets statuses only of runs that this
    holder holds or that nobody took (:class:`runstore.takeover.TakenRunStore`).
    """

    holder: str | None = None

    def __init__(self, url: str, checkpoint_dir: str | Path | None = None,
                 clock: Callable[[], float] = time.time, checkpoints: str | None = None) -> None:
        self.url, self.clock = url, clock
        # one line naming the store and the fix for whatever fails (runstore/opening.py)
        self.engine = open_engine(url, Base.metadata)  # the schema's alembic revisions applied
        where = checkpoints if checkpoints is not None else os.environ.get(CHECKPOINTS_ENV) or None
        self.checkpoints: Checkpoints = (FolderCheckpoints(Path(checkpoint_dir)) if checkpoint_dir is not None
                                         else checkpoints_at(where, url))
        beside = checkpoints_at(None, url)  # a reader's folder for files recorded elsewhere (a store moved)
        self.checkpoint_dir = (self.checkpoints.folder if isinstance(self.checkpoints, FolderCheckpoints)
                               else beside.folder if isinstance(beside, FolderCheckpoints) else None)
        # the object store this reader may read checkpoints from (never a URL a row alone names)
        self.checkpoint_url = self.checkpoints.url if isinstance(self.checkpoints, UrlCheckpoints) else None

    def session(self) -> Session:
        """Open a session on the store (objects stay readable after a commit)."""
        return Session(self.engine, expire_on_commit=False)

    def close(self) -> None:
        """Close the store's pooled connections (a database server's); the store opens new ones if used again."""
        self.engine.dispose()

    def __enter__(self) -> Self:
        """Return the store, closed (:meth:`close`) when the block ends."""
        return self

    def __exit__(self, *_exc: object) -> None:
        """Close the store's connections (:meth:`close`), whatever ended the block."""
        self.close()

    # -- runs -------------------------------------------------------------
    def create_run(self, *, name: str, scenario: dict[str, Any], seed: int, strategy: str, rounds: int,
                   engine: str = "inprocess", num_params: int = 0, info: dict[str, Any] | None = None,
                   rounds_done: int = 0) -> str:
        """Create a new ``running`` run, with a first lease, and return its id.

        Its owner's :class:`~runstore.lease.Heartbeat` renews the lease;
        ``rounds_done`` is above 0 for a run that starts from another's
        checkpoint.
        """
        run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        now = self.clock()
        with self.session() as s, s.begin():
            s.add(Run(id=run_id, name=name, scenario=scenario, seed=seed, status=RunStatus.RUNNING,
                      engine=engine, strategy=strategy, rounds_total=rounds, rounds_done=rounds_done,
                      num_params=num_params, started_at=now, updated_at=now, info=info or {},
                      heartbeat_at=now, lease_until=now + lease_seconds()))
        return run_id

    def get_run(self, run_id: str) -> Run:
        """Return the run whose id is ``run_id``, or the one run whose id starts (or else ends) with it.

        Every command that takes a run id looks it up here. The text is
        compared literally, in Python (``%`` and ``_`` are no SQL wildcards,
        and case matters), so ``20261202-1`` names a run only if it is the one
        run of the store whose id starts so; the random tail of an id
        (``a3f9c2``) names it as well. Its status is the one shown: a running
        run whose lease has expired reads ``interrupted``.

        Raises
        ------
        RunNotFound
            No run matches; or several do (``ambiguous: N runs start with ...``,
            naming a few).
        """
        with self.session() as s:
            run = s.get(Run, run_id) or s.get(Run, _unique_match(run_id, list(s.scalars(select(Run.id))), self.url))
            if run is None:  # deleted between the two reads
                raise RunNotFound(f"no run {run_id!r} in {self.url}")
            return as_shown(run, self.clock())

    def list_runs(self, status: str | None = None) -> list[Run]:
        """List runs newest first (only those that read ``status``), each with the status shown."""
        now = self.clock()
        with self.session() as s:
            query = select(Run).order_by(Run.started_at.desc())
            if status:
                query = query.where(status_is(status, now))
            return [as_shown(run, now) for run in s.scalars(query).all()]

    def _run_to_write(self, s: Session, run_id: str) -> Run:
        """Return the run's row, locked until the transaction ends, once this store may write it.

        A store with a :attr:`holder` writes only a run it holds (or one no process took). The check is the
        transaction's first statement, an UPDATE guarded by it: it takes SQLite's write lock and
        PostgreSQL's row lock, so a process that took the run meanwhile is either seen here or waited for,
        never overwritten (a SELECT first would hold no lock on SQLite, whose driver begins a transaction
        only at the first write).
        """
        _lock_row(s, run_id, self._held())
        run = s.get(Run, run_id)
        if run is None:
            raise RunNotFound(f"no run {run_id!r} in {self.url}")
        if self.holder is not None and run.holder not in (None, self.holder):
            raise LeaseLost(f"lost run {run_id} to {run.holder}: another process took it over at round "
                            f"{run.rounds_done}; this one stopped without writing")
        return run

    def _held(self) -> ColumnElement[bool]:
        """Select the runs this store may write: any, or (with a :attr:`holder`) those it holds or nobody took."""
        return Run.holder.is_(None) | (Run.holder == self.holder) if self.holder is not None else true()

    def set_status(self, run_id: str, status: str, error: str | None = None) -> None:
        """Change a run's status; ``running`` grants a fresh lease, any other ends it."""
        with self.session() as s, s.begin():
            run = self._run_to_write(s, run_id)
            run.status, run.error, run.updated_at = status, error, time.time()
            run.finished_at = time.time() if status != RunStatus.RUNNING else None
            run.heartbeat_at = now = self.clock()
            run.lease_until = now + lease_seconds() if status == RunStatus.RUNNING else None

    def renew_lease(self, run_id: str, lease_s: float) -> None:
        """Note that the run's owner is alive, until ``lease_s`` from now.

        A running run only: a run that ended stays ended. ``updated_at`` is
        left alone: nothing a page shows has changed.
        """
        now = self.clock()
        with self.session() as s, s.begin():
            s.execute(update(Run).where(Run.id == run_id, Run.status == RunStatus.RUNNING, self._held())
                      .values(heartbeat_at=now, lease_until=now + lease_s))

    def update_info(self, run_id: str, **info: Any) -> None:
        """Merge ``info`` into the run's recorded ``info``, key by key."""
        with self.session() as s, s.begin():
            _lock_row(s, run_id, true())  # of two merges at once, both keys stay
            run = s.get(Run, run_id)
            if run is None:
                raise RunNotFound(f"no run {run_id!r} in {self.url}")
            run.info = {**(run.info or {}), **info}

    def log(self, run_id: str, message: str, level: str = "info") -> None:
        """Append ``message`` to the run's log at ``level`` (a store with a :attr:`holder`: to a run it may write)."""
        with self.session() as s, s.begin():
            if self.holder is not None:  # a driver that lost its run adds no line to it
                self._run_to_write(s, run_id)
            s.add(Event(run_id=run_id, ts=time.time(), level=level, message=message))

    # -- rounds -----------------------------------------------------------
    def commit_round(self, run_id: str, record: RoundRecord, state: ServerState) -> None:
        """Write the checkpoint, then the round and its client results atomically."""
        blob = encode_state(state, f"round {record.round} of run {run_id}")
        with self.session() as s, s.begin():
            run = self._run_to_write(s, run_id)
            if s.get(Round, (run_id, record.round)) is not None:
                raise StoreError(f"run {run_id} already has round {record.round} committed")
            reference = self.checkpoints.write(s, run_id, record.round, blob)
            s.add(_round_row(run_id, record, reference, Headline.from_info(run.info)))
            rows = _client_rows(run_id, record)
            # an executemany per CLIENT_ROWS_AT_ONCE rows (not an ORM object per row), in the round's one
            # transaction: a round of 100,000 clients never holds all its rows' parameters at once
            while batch := list(itertools.islice(rows, CLIENT_ROWS_AT_ONCE)):
                s.execute(insert(ClientResult), batch)
            run.rounds_done, run.updated_at = record.round, time.time()

    def rounds(self, run_id: str) -> list[Round]:
        """Return the run's committed rounds, in order."""
        with self.session() as s:
            return list(s.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.round)).all())

    def client_results(self, run_id: str, server_round: int | None = None) -> list[ClientResult]:
        """Return the run's client results (of ``server_round`` only, when given), by round, as stored."""
        with self.session() as s:
            query = select(ClientResult).where(ClientResult.run_id == run_id)
            if server_round is not None:
                query = query.where(ClientResult.round == server_round)
            return list(s.scalars(query.order_by(ClientResult.round, ClientResult.id)).all())

    def events(self, run_id: str) -> list[Event]:
        """Return the run's log, oldest first."""
        with self.session() as s:
            return list(s.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.id)).all())

    # -- checkpoints ------------------------------------------------------
    def load_state(self, run_id: str, server_round: int | None = None) -> ServerState | None:
        """Load the server state committed with ``server_round`` (default: the last one).

        Raises
        ------
        StoreError
            The round's checkpoint is gone, cannot be read, or its reference is not where that round writes.
        """
        with self.session() as s:
            found = _round_checkpoint(s, run_id, server_round)
            if found is None:
                return None
            number, reference = found
            blob = read_blob(s, reference, self.checkpoint_dir, self.checkpoint_url)
        if blob is None:
            raise StoreError(f"the checkpoint of round {number} of run {run_id} is gone from "
                             f"{self.checkpoints.describe()} ({reference})")
        return decode_state(blob, reference)

    def has_checkpoint(self, run_id: str, server_round: int | None = None) -> bool:
        """Whether a round (default: the last) has a checkpoint that is there and whole, reading its header only."""
        try:
            opened = self._open_checkpoint(run_id, server_round, with_reference=False)
        except StoreError:
            return False  # damaged, or not a regular file: not offered
        if opened is None:
            return False
        opened[1].release()
        return True

    def checkpoint_source(self, run_id: str, server_round: int | None = None) -> tuple[int, Blob] | None:
        """Return a round's number and checkpoint (default: the last round), opened and checked, to be streamed.

        The blob's framing is checked before its first byte is read
        (:func:`runstore.checkpoints.open_blob`); ``None`` when that round has
        no checkpoint, it is gone, or it lies where this reader may not read.

        Raises
        ------
        StoreError
            The checkpoint is damaged or is not a regular file: one line naming the round, never its path.
        """
        return self._open_checkpoint(run_id, server_round, with_reference=False)

    def checkpoint_blob(self, run_id: str, server_round: int | None = None) -> tuple[int, bytes] | None:
        """Return the round number and safetensors bytes of a round's checkpoint (default: the last round).

        ``None`` when that round has no checkpoint, or it is gone.

        Raises
        ------
        StoreError
            The checkpoint is damaged or is not a regular file: one line naming the round and its reference.
        """
        opened = self._open_checkpoint(run_id, server_round, with_reference=True)
        return None if opened is None else (opened[0], opened[1].read())

    def _open_checkpoint(self, run_id: str, server_round: int | None,
                         with_reference: bool) -> tuple[int, Blob] | None:
        """Open a round's checkpoint (:func:`runstore.checkpoints.open_blob`); ``None``: none this reader may read."""
        with self.session() as s:
            found = _readable_checkpoint(s, run_id, server_round)
        if found is None:
            return None
        number, reference = found
        name = f"the checkpoint of round {number} of run {run_id}"
        if with_reference:
            name += f" ({reference[:400]})"
        blob = open_blob(self.session, reference, self.checkpoint_dir, self.checkpoint_url, name)
        return None if blob is None else (number, blob)


def _round_checkpoint(s: Session, run_id: str, server_round: int | None) -> tuple[int, str] | None:
    """Return a round's number and checked checkpoint reference (default: the last round); ``None``: no round.

    Raises
    ------
    StoreError
        The reference is not where that round writes (:func:`runstore.checkpoints.checked_reference`).
    """
    query = select(Round.round, Round.checkpoint).where(Round.run_id == run_id)
    if server_round is not None:
        query = query.where(Round.round == server_round)
    row = s.execute(query.order_by(Round.round.desc()).limit(1)).first()
    if row is None:
        return None
    return row.round, checked_reference(row.checkpoint or "", run_id, row.round)


def _readable_checkpoint(s: Session, run_id: str, server_round: int | None) -> tuple[int, str] | None:
    """:func:`_round_checkpoint`, with a refused or empty reference read as no checkpoint (what pages show)."""
    try:
        return _round_checkpoint(s, run_id, server_round)
    except StoreError:
        return None


def read_checkpoint(path: str | Path) -> ServerState:
    """Load a ``ServerState`` from a safetensors checkpoint file."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise StoreError(f"cannot read checkpoint {path}: {exc}") from None
    return decode_state(data, str(path))


def _unique_match(text: str, ids: list[str], url: str) -> str:
    """Return the one id of ``ids`` that starts with ``text`` (or, when none does, ends with it)."""
    for how, matches in (("start", [i for i in ids if text and i.startswith(text)]),
                         ("end", [i for i in ids if text and i.endswith(text)])):
        if len(matches) == 1:
            return matches[0]
        if matches:
            shown = ", ".join(sorted(matches)[:3]) + (", ..." if len(matches) > 3 else "")
            raise RunNotFound(f"ambiguous: {len(matches)} runs {how} with {text!r} in {url} ({shown}); "
                              "give more of the id")
    raise RunNotFound(f"no run {text!r} in {url}")


def _count(value: Any, high: int = MAX_EXAMPLES) -> int:
    """Bound a count to ``[0, high]``: no client figure overflows a column or a SUM over it."""
    return min(max(int(value), 0), high) if isinstance(value, (int, float)) and np.isfinite(value) else 0


def _real(value: Any) -> float | None:
    """Return a finite float, else ``None`` (SQLite stores NaN as NULL, JSON pages choke on Inf)."""
    return float(value) if isinstance(value, (int, float)) and np.isfinite(value) else None


def _round_row(run_id: str, r: RoundRecord, checkpoint: str, headline: Headline) -> Round:
    return Round(run_id=run_id, round=r.round, started_at=r.started_at, duration_s=r.duration_s,
                 sampled=r.sampled, answered=r.count(ClientStatus.OK),
                 dropped=r.count(ClientStatus.DROPPED) + r.count(ClientStatus.LATE),
                 rejected=r.count(ClientStatus.REJECTED),
                 failed=r.count(ClientStatus.FAILED) + r.count(ClientStatus.ERROR),
                 train_loss=_real(r.train_loss),
                 fed_loss=_real(r.fed_loss), fed_accuracy=_real(r.fed_accuracy), server_loss=_real(r.server_loss),
                 server_accuracy=_real(r.server_accuracy), bytes_in=r.bytes_in, bytes_out=r.bytes_out,
                 epsilon=_real(r.epsilon), secagg=r.secagg, tree=r.tree, metrics=_with_refused(r),
                 checkpoint=checkpoint, headline=_real(round_value(headline, r)[0]))


def _with_refused(r: RoundRecord) -> dict[str, Any]:
    """Return the round's metrics, with ``refused``: its clients whose site policy refused (no column of its own)."""
    refused = r.count(ClientStatus.REFUSED)
    return {**(r.metrics or {}), "refused": refused} if refused else dict(r.metrics or {})


#: The key of a client's stored metrics that names the edge aggregator it trained under ([hierarchy]).
EDGE_METRIC = "edge"
#: Client rows inserted per statement when a round commits.
CLIENT_ROWS_AT_ONCE = 2000


def _client_rows(run_id: str, r: RoundRecord) -> Iterator[dict[str, Any]]:
    now = time.time()
    for c in r.clients:
        yield dict(run_id=run_id, round=r.round, client=c.client, outcome=c.outcome,
                   stage=c.stage, reason=c.reason, num_examples=_count(c.num_examples),
                   train_loss=_real(c.train_loss), eval_loss=_real(c.eval_loss),
                   eval_accuracy=_real(c.eval_accuracy), duration_s=_real(c.duration_s),
                   bytes_in=_count(c.bytes_in, 2**53), bytes_out=_count(c.bytes_out, 2**53),
                   metrics=clean_metrics(_with_edge(c.metrics, c.edge)), finished_at=now)


def _with_edge(metrics: dict[str, Any] | None, edge: int | None) -> dict[str, Any]:
    """Return a client's metrics as stored: with the edge it trained under, in a tree (``[hierarchy]``)."""
    if edge is None:
        return metrics or {}
    return {EDGE_METRIC: edge, **{k: v for k, v in (metrics or {}).items() if k != EDGE_METRIC}}
