"""Read-only queries over the run store, each in its own short session.

The aggregator writes the same SQLite file while a run is in progress (WAL
mode): every method here opens a session, reads, and closes it at once, so a
reader never holds a snapshot that keeps the writer's log from checkpointing.
Aggregates are computed in SQL, one query per page, not per row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Select, Subquery, and_, case, func, or_, select
from sqlalchemy.orm import Session

from core.headline import Headline, round_scores
from core.status import ClientStatus, RunStatus
from runstore.blobs import Blob
from runstore.lease import INTERRUPTED, lease_expired
from runstore.store import ClientResult, Event, Round, Run, RunStore, as_shown, status_is

__all__ = ["Reader", "RunStats", "RunHead", "ClientSummary", "Participation", "TERMINAL", "changed_at"]

# Accuracy of a round: the server's held-out score when it has one, else the federated one.
ACCURACY = func.coalesce(Round.server_accuracy, Round.fed_accuracy)
TERMINAL = frozenset(RunStatus) - {RunStatus.RUNNING}
RECENT = 30  # participations shown per client on the clients page


@dataclass(frozen=True)
class RunStats:
    """Per-run aggregates over its committed rounds."""

    rounds: int = 0
    best_accuracy: float | None = None
    last_accuracy: float | None = None
    last_round: int = 0
    epsilon: float | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    answered: int = 0
    dropped: int = 0
    rejected: int = 0
    failed: int = 0
    duration_sum: float = 0.0
    last_duration: float | None = None
    # The run's headline metric (core.headline): its highest and lowest value over the rounds (which is best
    # depends on the metric's direction, in run.info), its value and every task score of the last round.
    metric_high: float | None = None
    metric_low: float | None = None
    last_metric: float | None = None
    last_scores: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class RunHead:
    """What the live stream polls: cheap, by primary key."""

    status: str
    last_round: int
    updated_at: float


@dataclass(frozen=True)
class Participation:
    """One round a client took part in: the run, round, outcome, and the stage and reason of a failure."""

    run_id: str
    round: int
    outcome: str
    stage: str | None
    reason: str | None


@dataclass(frozen=True)
class ClientSummary:
    """One client's totals over the runs asked for, with its most recent participations (newest first)."""

    client: str
    rounds: int
    ok: int
    dropped: int
    rejected: int
    runs: int
    examples: int
    last_seen: float
    failed: int = 0
    recent: list[Participation] = field(default_factory=list)  # newest first


def changed_at(run: Run) -> float:
    """Return when a run (as :class:`Reader` returns it) last changed for a reader.

    That is its last write, or the moment its lease expired (a run that reads
    ``interrupted`` without a write).
    """
    lapsed = run.lease_until if run.status == INTERRUPTED and run.lease_until is not None else 0.0
    return max(run.updated_at, lapsed)


class Reader:
    """Short read sessions over a :class:`RunStore`'s engine."""

    def __init__(self, db_url: str) -> None:
        self.store = RunStore(db_url)

    @contextmanager
    def _session(self) -> Iterator[Session]:
        with Session(self.store.engine, expire_on_commit=False) as session:
            yield session

    # -- runs ---------------------------------------------------------------
    def runs(self, status: str | None = None, limit: int | None = None,
             offset: int = 0) -> list[tuple[Run, RunStats]]:
        """List runs newest first, optionally one status only and one page (``limit`` from ``offset``).

        Every run here (and from :meth:`run`, :meth:`changed_runs`, :meth:`head`) carries the
        status a reader shows: a running run whose lease expired reads ``interrupted``.
        """
        now = self.store.clock()
        with self._session() as s:
            query = select(Run).order_by(Run.started_at.desc(), Run.id)
            if status:
                query = query.where(status_is(status, now))
            if limit is not None:
                query = query.limit(limit)
            if offset:
                query = query.offset(offset)
            runs = [as_shown(r, now) for r in s.scalars(query).all()]
            whole = status is None and limit is None and not offset
            stats = _stats(s, None if whole else [r.id for r in runs])
        return [(r, stats.get(r.id, RunStats())) for r in runs]

    def run(self, run_id: str) -> tuple[Run, RunStats] | None:
        """Return one run with its round statistics, or None when there is no such run."""
        with self._session() as s:
            run = s.get(Run, run_id)
            if run is None:
                return None
            return as_shown(run, self.store.clock()), _stats(s, [run_id]).get(run_id, RunStats())

    def changed_runs(self, since: float) -> list[tuple[Run, RunStats]]:
        """List the runs that changed for a reader after ``since``, with their round statistics.

        These are runs whose row changed after ``since`` (new, new round, new
        status), and running runs whose lease expired after ``since`` (they now
        read ``interrupted``; :func:`changed_at` dates both).
        """
        now = self.store.clock()
        lapsed = and_(Run.status == RunStatus.RUNNING, Run.lease_until > since, Run.lease_until < now)
        with self._session() as s:
            runs = [as_shown(r, now) for r in s.scalars(select(Run).where(or_(Run.updated_at > since, lapsed)))]
            stats = _stats(s, [r.id for r in runs]) if runs else {}
        return [(r, stats.get(r.id, RunStats())) for r in runs]

    def last_update(self) -> float:
        """Return the latest ``updated_at`` over all runs (0.0 when there are none)."""
        with self._session() as s:
            return s.scalar(select(func.max(Run.updated_at))) or 0.0

    def status_counts(self) -> dict[str, int]:
        """Count runs per status shown (running runs whose lease expired count as ``interrupted``)."""
        now = self.store.clock()
        with self._session() as s:
            rows = s.execute(select(Run.status, func.count()).group_by(Run.status)).all()
            lapsed = s.scalar(select(func.count()).select_from(Run).where(Run.status == RunStatus.RUNNING,
                                                                          Run.lease_until < now)) or 0
        counts = {status: count for status, count in rows}
        if lapsed:
            counts[RunStatus.RUNNING] -= lapsed
            counts[INTERRUPTED] = counts.get(INTERRUPTED, 0) + lapsed
        return {status: count for status, count in counts.items() if count}

    def head(self, run_id: str) -> RunHead | None:
        """Return a run's status shown, last round and last write, or None when there is no such run."""
        with self._session() as s:
            row = s.execute(select(Run.status, Run.updated_at, Run.lease_until).where(Run.id == run_id)).first()
            if row is None:
                return None
            last = s.scalar(select(func.max(Round.round)).where(Round.run_id == run_id))
        status = INTERRUPTED if lease_expired(row.status, row.lease_until, self.store.clock()) else row.status
        return RunHead(status=status, last_round=last or 0, updated_at=row.updated_at)

    def headline(self, run_id: str) -> Headline:
        """Return the run's headline metric (``accuracy`` for an unknown run, or one stored before runs recorded it)."""
        with self._session() as s:
            return Headline.from_info(s.scalar(select(Run.info).where(Run.id == run_id)))

    # -- rounds -------------------------------------------------------------
    def rounds(self, run_id: str, after: int = 0) -> list[Round]:
        """List a run's rounds numbered above ``after``, in round order."""
        with self._session() as s:
            query = select(Round).where(Round.run_id == run_id, Round.round > after)
            return list(s.scalars(query.order_by(Round.round)).all())

    def round(self, run_id: str, number: int) -> Round | None:
        """Return round ``number`` of a run, or None when it was not recorded."""
        with self._session() as s:
            return s.get(Round, (run_id, number))

    def last_trees(self, run_ids: Sequence[str] | None = None) -> dict[str, Any]:
        """Map run id -> the tree (``rounds.tree``, as stored) of its last committed round, in one query.

        Only the runs whose last round recorded one (``[hierarchy]``); all runs when ``run_ids`` is None.
        """
        if run_ids is not None and not run_ids:
            return {}
        sub = _last_round_numbers(run_ids)
        query = select(Round.run_id, Round.tree).join(sub, and_(Round.run_id == sub.c.run_id,
                                                                 Round.round == sub.c.last))
        with self._session() as s:
            return {row.run_id: row.tree for row in s.execute(query).all() if row.tree is not None}

    def round_clients(self, run_id: str, number: int) -> list[ClientResult]:
        """List the client results of one round of a run, in the order they were recorded."""
        with self._session() as s:
            query = select(ClientResult).where(ClientResult.run_id == run_id, ClientResult.round == number)
            return list(s.scalars(query.order_by(ClientResult.id)).all())

    def events(self, run_id: str, limit: int = 200) -> list[Event]:
        """List a run's last ``limit`` events, oldest first."""
        with self._session() as s:
            query = select(Event).where(Event.run_id == run_id).order_by(Event.id.desc()).limit(limit)
            return list(reversed(s.scalars(query).all()))

    def checkpoint(self, run_id: str, number: int | None = None) -> tuple[int, Blob] | None:
        """Return the round number and a round's checkpoint (default: the last round), opened and checked.

        From wherever the store keeps them (``runstore.checkpoints``): read
        from the opened file, the database's chunks one at a time, or an
        object's reads. None when that round has no checkpoint or it is gone.

        Raises
        ------
        StoreError
            The checkpoint is damaged or is not a regular file (never served): one line.
        """
        return self.store.checkpoint_source(run_id, number)

    # -- clients ------------------------------------------------------------
    def clients(self, runs: str | Sequence[str] | None = None, limit: int | None = None,
                offset: int = 0, public: bool = False) -> list[ClientSummary]:
        """Sum each client's participations over ``runs`` (one run, several, or all when None).

        Clients come in natural order ("2" before "10", names after numbers);
        one page of ``limit`` from ``offset``. ``public`` leaves out the runs
        that hide their participants (``[dp] enabled``), decided in the same query.
        """
        scope = _scope(runs)
        with self._session() as s:
            query = _public(_client_totals(scope), public).order_by(*_natural_order())
            if limit is not None:
                query = query.limit(limit)
            if offset:
                query = query.offset(offset)
            totals = s.execute(query).all()
            page = [r.client for r in totals] if limit is not None else None
            recent = s.execute(_client_recent(scope, page, public)).all() if totals else []
        history: dict[str, list[Participation]] = {}
        for row in recent:
            history.setdefault(row.client, []).append(
                Participation(row.run_id, row.round, row.outcome, row.stage, row.reason))
        return [ClientSummary(client=r.client, rounds=r.rounds, ok=r.ok or 0, dropped=r.dropped or 0,
                              rejected=r.rejected or 0, failed=r.failed or 0, runs=r.runs, examples=r.examples or 0,
                              last_seen=r.last_seen, recent=history.get(r.client, []))
                for r in totals]

    def count_clients(self, runs: str | Sequence[str] | None = None, public: bool = False) -> int:
        """How many distinct clients took part in ``runs`` (all runs when None; see :meth:`clients`)."""
        query = _public(select(func.count(ClientResult.client.distinct())), public)
        scope = _scope(runs)
        if scope is not None:
            query = query.where(ClientResult.run_id.in_(scope))
        with self._session() as s:
            return int(s.execute(query).scalar_one())

    def client_history(self, client: str, run_id: str | None = None, limit: int = 1000) -> list[ClientResult]:
        """List a client's last ``limit`` results, newest first, in one run or (``run_id`` None) all."""
        with self._session() as s:
            query = select(ClientResult).where(ClientResult.client == client)
            if run_id:
                query = query.where(ClientResult.run_id == run_id)
            return list(s.scalars(query.order_by(ClientResult.id.desc()).limit(limit)).all())

    def run_names(self, run_ids: Sequence[str]) -> dict[str, str]:
        """Map run id -> run name for the given runs (ids not stored are left out)."""
        if not run_ids:
            return {}
        with self._session() as s:
            rows = s.execute(select(Run.id, Run.name).where(Run.id.in_(set(run_ids)))).all()
        return {row.id: row.name for row in rows}


def natural_key(label: str) -> tuple[int, int, str]:
    """Sort client labels numerically when they are numbers ("2" before "10")."""
    return (0, int(label), "") if label.isdigit() else (1, 0, label)


def _stats(s: Session, run_ids: Sequence[str] | None) -> dict[str, RunStats]:
    """Aggregate each run's rounds (all runs when ``run_ids`` is None): two queries in all."""
    if run_ids is not None and not run_ids:
        return {}
    last = {row.run_id: row for row in s.execute(_last_rounds(run_ids)).all()}
    out = {}
    for r in s.execute(_totals(run_ids)).all():
        tail = last.get(r.run_id)
        out[r.run_id] = RunStats(
            rounds=r.rounds, best_accuracy=r.best, last_round=r.last_round or 0, epsilon=r.epsilon,
            bytes_in=r.bytes_in or 0, bytes_out=r.bytes_out or 0, answered=r.answered or 0,
            dropped=r.dropped or 0, rejected=r.rejected or 0, failed=r.failed or 0,
            duration_sum=r.duration_sum or 0.0,
            last_accuracy=None if tail is None else tail.accuracy,
            last_duration=None if tail is None else tail.duration_s,
            metric_high=r.metric_high, metric_low=r.metric_low,
            last_metric=None if tail is None else tail.headline,
            last_scores={} if tail is None else round_scores(tail))
    return out


def _totals(run_ids: Sequence[str] | None) -> Select[*tuple[Any, ...]]:
    query = select(Round.run_id, func.count().label("rounds"), func.max(ACCURACY).label("best"),
                   func.max(Round.round).label("last_round"), func.max(Round.epsilon).label("epsilon"),
                   func.sum(Round.bytes_in).label("bytes_in"), func.sum(Round.bytes_out).label("bytes_out"),
                   func.sum(Round.answered).label("answered"), func.sum(Round.dropped).label("dropped"),
                   func.sum(Round.rejected).label("rejected"), func.sum(Round.failed).label("failed"),
                   func.sum(Round.duration_s).label("duration_sum"), func.max(Round.headline).label("metric_high"),
                   func.min(Round.headline).label("metric_low")).group_by(Round.run_id)
    return query if run_ids is None else query.where(Round.run_id.in_(run_ids))


def _last_round_numbers(run_ids: Sequence[str] | None) -> Subquery:
    """Each run's last round number (``run_id``, ``last``), all runs' when ``run_ids`` is None."""
    last = select(Round.run_id.label("run_id"), func.max(Round.round).label("last")).group_by(Round.run_id)
    if run_ids is not None:
        last = last.where(Round.run_id.in_(run_ids))
    return last.subquery()


def _last_rounds(run_ids: Sequence[str] | None) -> Select[*tuple[Any, ...]]:
    sub = _last_round_numbers(run_ids)
    return select(Round.run_id, ACCURACY.label("accuracy"), Round.duration_s, Round.headline, Round.server_accuracy,
                  Round.fed_accuracy, Round.server_loss, Round.fed_loss, Round.metrics).join(
        sub, and_(Round.run_id == sub.c.run_id, Round.round == sub.c.last))


def _count_if(condition: ColumnElement[bool]) -> ColumnElement[int]:
    return func.sum(case((condition, 1), else_=0))


def _scope(runs: str | Sequence[str] | None) -> list[str] | None:
    return None if runs is None else [runs] if isinstance(runs, str) else list(runs)


def _public(query: Select[*tuple[Any, ...]], public: bool) -> Select[*tuple[Any, ...]]:
    """Without the client rows of runs whose scenario enables DP (``dashboard.privacy.hides_clients``)."""
    if not public:
        return query
    private = select(Run.id).where(func.coalesce(func.json_extract(Run.scenario, "$.dp.enabled"), 0) != 0)
    return query.where(ClientResult.run_id.not_in(private))


def _natural_order() -> tuple[ColumnElement[Any], ...]:
    """Return SQL's form of :func:`natural_key` as ORDER BY terms.

    Numeric labels come first, by value (length without leading zeros, then
    text), then names (the empty label among them) alphabetically.
    """
    client = ClientResult.client
    is_name = or_(func.length(func.trim(client, "0123456789")) > 0, client == "")
    value = func.ltrim(client, "0")  # a number's digits without leading zeros: by length, then by text
    return (case((is_name, 1), else_=0), case((is_name, 0), else_=func.length(value)),
            case((is_name, client), else_=value), client.expression)


def _client_totals(runs: list[str] | None) -> Select[*tuple[Any, ...]]:
    query = select(ClientResult.client, func.count().label("rounds"),
                   _count_if(ClientResult.outcome == ClientStatus.OK).label("ok"),
                   _count_if(ClientResult.outcome.in_((ClientStatus.DROPPED, ClientStatus.LATE))).label("dropped"),
                   _count_if(ClientResult.outcome == ClientStatus.REJECTED).label("rejected"),
                   _count_if(ClientResult.outcome.in_((ClientStatus.FAILED, ClientStatus.ERROR))).label("failed"),
                   func.count(ClientResult.run_id.distinct()).label("runs"),
                   func.sum(ClientResult.num_examples).label("examples"),
                   func.max(ClientResult.finished_at).label("last_seen")).group_by(ClientResult.client)
    return query if runs is None else query.where(ClientResult.run_id.in_(runs))


def _client_recent(runs: list[str] | None, clients: list[str] | None, public: bool) -> Select[*tuple[Any, ...]]:
    rank = func.row_number().over(partition_by=ClientResult.client, order_by=ClientResult.id.desc())
    inner = select(ClientResult.client, ClientResult.run_id, ClientResult.round, ClientResult.outcome,
                   ClientResult.stage, ClientResult.reason, ClientResult.id, rank.label("rank"))
    if runs is not None:
        inner = inner.where(ClientResult.run_id.in_(runs))
    if clients is not None:  # one page's clients only
        inner = inner.where(ClientResult.client.in_(clients))
    sub = _public(inner, public).subquery()
    return select(sub).where(sub.c.rank <= RECENT).order_by(sub.c.client, sub.c.id.desc())

