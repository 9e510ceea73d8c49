"""Remote run submissions: a queue in the run store, filled by the dashboard, drained by the leading aggregator.

The dashboard (``dashboard/submit.py``) is a separate process over the run
store and never reaches the SuperLink: a lead's ``POST /api/runs`` (or a stop,
or a resume) becomes one ``pending`` row of ``submissions``. The aggregator
that leads the federation (``deploy/submissions.py``, from its supervisor's
watch loop) takes the oldest pending row of its federation, submits through
its in-process Control API, and finishes it ``done`` (with the Flower run id)
or ``failed`` (with the reason). A standby that takes over after a failover
drains the same queue: it lives in the shared store.

:func:`take` is atomic: a conditional ``UPDATE ... WHERE status = 'pending'``
changes the row for one taker only, so two aggregators never submit the same
row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, Float, Integer, String, select, update
from sqlalchemy.orm import Mapped, mapped_column

from core.errors import QuorumError
from runstore.base import Base

if TYPE_CHECKING:
    from runstore.store import RunStore

__all__ = ["KINDS", "STATUSES", "PENDING", "TAKEN", "DONE", "FAILED", "SubmissionError", "SubmissionRow",
           "Submission", "enqueue", "take", "finish", "attach_run", "get"]

KINDS = ("submit", "stop", "resume")
PENDING, TAKEN, DONE, FAILED = "pending", "taken", "done", "failed"
STATUSES = (PENDING, TAKEN, DONE, FAILED)
_TRIES = 5


class SubmissionError(QuorumError):
    """A submission of an unknown kind, without what its kind needs, or naming no queued submission."""


class SubmissionRow(Base):
    """One queued request: who asked for what (a scenario to run, a run to stop or resume), and how it went."""

    __tablename__ = "submissions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[float] = mapped_column(Float)
    account: Mapped[str] = mapped_column(String(64), index=True)
    org: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    federation: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    scenario: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    taken_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)


@dataclass(frozen=True)
class Submission:
    """A submission as read: a detached copy of its row."""

    id: int
    created_at: float
    account: str
    org: str
    kind: str
    federation: str | None
    run_id: str | None
    scenario: dict[str, Any] | None
    status: str
    result: dict[str, Any]
    taken_by: str | None
    updated_at: float

    def as_dict(self) -> dict[str, Any]:
        """Return what the dashboard shows of it (its scenario left out: the run has it)."""
        return {"id": self.id, "kind": self.kind, "account": self.account, "org": self.org,
                "federation": self.federation, "run_id": self.run_id, "status": self.status,
                "result": self.result, "created_at": self.created_at, "updated_at": self.updated_at}


def _copy(row: SubmissionRow) -> Submission:
    return Submission(id=row.id, created_at=row.created_at, account=row.account, org=row.org, kind=row.kind,
                      federation=row.federation, run_id=row.run_id, scenario=row.scenario, status=row.status,
                      result=dict(row.result or {}), taken_by=row.taken_by, updated_at=row.updated_at)


def enqueue(store: RunStore, account: str, org: str, kind: str, *, federation: str | None = None,
            run_id: str | None = None, scenario: dict[str, Any] | None = None) -> int:
    """Queue a request; return its id.

    Raises
    ------
    SubmissionError
        An unknown kind, a ``submit`` without a scenario, or a stop or resume without a run.
    """
    if kind not in KINDS:
        raise SubmissionError(f"submission kind {kind!r}: one of {', '.join(KINDS)}")
    if kind == "submit" and scenario is None:
        raise SubmissionError("a submission of a run needs its scenario")
    if kind != "submit" and not run_id:
        raise SubmissionError(f"a {kind} needs the run it applies to")
    now = store.clock()
    with store.session() as s, s.begin():
        row = SubmissionRow(created_at=now, account=account, org=org, kind=kind, federation=federation,
                            run_id=run_id, scenario=scenario, status=PENDING, result=None, updated_at=now)
        s.add(row)
        s.flush()
        return int(row.id)


def take(store: RunStore, taker: str, federation: str) -> Submission | None:
    """Take the oldest pending submission for ``federation`` (or for any, when it names none); None if none waits.

    Taking is a conditional update: of two takers of one row, one changes it and the other looks again.
    """
    for _ in range(_TRIES):
        with store.session() as s, s.begin():
            oldest = s.scalar(select(SubmissionRow.id).where(
                SubmissionRow.status == PENDING,
                (SubmissionRow.federation == federation) | SubmissionRow.federation.is_(None))
                .order_by(SubmissionRow.id).limit(1))
            if oldest is None:
                return None
            done = s.execute(update(SubmissionRow).where(SubmissionRow.id == oldest, SubmissionRow.status == PENDING)
                             .values(status=TAKEN, taken_by=taker[:128], updated_at=store.clock()))
            if int(done.rowcount or 0) == 1:  # type: ignore[attr-defined]
                row = s.get(SubmissionRow, oldest)
                return _copy(row) if row is not None else None
    return None


def finish(store: RunStore, submission_id: int, ok: bool, **result: Any) -> None:
    """Mark a submission ``done`` (``ok``) or ``failed``, with what came of it (a Flower run id, an error)."""
    with store.session() as s, s.begin():
        row = s.get(SubmissionRow, submission_id)
        if row is None:
            raise SubmissionError(f"no submission {submission_id}")
        row.status = DONE if ok else FAILED
        row.result = {**(row.result or {}), **result}
        row.updated_at = store.clock()


def attach_run(store: RunStore, submission_id: int, run_id: str) -> None:
    """Record the stored run a submission opened (the ServerApp knows it once the run is created)."""
    with store.session() as s, s.begin():
        row = s.get(SubmissionRow, submission_id)
        if row is not None:
            row.run_id = run_id
            row.updated_at = store.clock()


def get(store: RunStore, submission_id: int) -> Submission | None:
    """Return one submission; None when there is no such id."""
    with store.session() as s:
        row = s.get(SubmissionRow, submission_id)
        return _copy(row) if row is not None else None
