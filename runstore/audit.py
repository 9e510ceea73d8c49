"""A tamper-evident audit trail: who did what, appended to a hash-chained table of the run store.

Logins (and failed ones), submissions, stops and resumptions, model,
checkpoint and export downloads, account and token changes, and the refusals
of a device's site policy each append one row to ``audit_log``: when, who
(an account's name, ``token`` for the single shared dashboard token,
``cli:USER``, ``device:NAME``), of which organisation, which action (one of
:data:`ACTIONS`), on what (a run id, an account's name) and a JSON object of
particulars. Each row carries the SHA-256 of the row before it (``prev``; 64
zeros for the first) and its own (``digest``), over this exact encoding::

    json.dumps([id, at, actor, org, action, target, detail, prev], sort_keys=True,
               separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")

``at`` is a float, written by ``repr`` (exact, so a row read back from SQLite
or PostgreSQL hashes the same); ``detail`` is hashed as the JSON value it
holds, not as the text the database keeps (whose spacing differs between
drivers). Ids are 1, 2, 3, ...: a row's id is the previous one's plus one,
chosen under a lock (PostgreSQL: a transaction advisory lock; SQLite: its
write lock, taken before the head is read), so two processes never fork the
chain; the primary key refuses the second of two rows with the same id
anyway.

What :func:`verify` proves: no row inside the chain was changed (any column,
its digest included), none was deleted, none was inserted, and the rows are
in the order they were written; it names the first row that fails.

What it does not prove: that no rows were cut off the end (the newest rows
deleted leave a shorter, valid chain), nor that someone with write access to
the database did not append rows of their own or rewrite the chain from some
row on, recomputing every digest (no secret goes into a digest). Anchor the
trail against these by publishing its head (:func:`head`, printed by ``quorum
audit --verify``) somewhere the database's writers cannot change, from time
to time: a trail that no longer leads to a published head was cut or rewritten.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Generator
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, Float, Integer, String, Text, cast, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column
from sqlalchemy.sql import Executable

from core.errors import QuorumError
from runstore.base import Base

if TYPE_CHECKING:
    from runstore.store import RunStore

__all__ = ["ACTIONS", "LOGIN", "LOGIN_FAILED", "LOGOUT", "SUBMIT", "STOP", "RESUME", "DOWNLOAD_MODEL",
           "DOWNLOAD_CHECKPOINT", "DOWNLOAD_EXPORT", "ACCOUNT_ADD", "ACCOUNT_REVOKE", "TOKEN_ISSUE", "TOKEN_REVOKE",
           "POLICY_REFUSAL", "GENESIS", "MAX_DETAIL_BYTES", "AuditError", "AuditLog", "AuditRow", "Verification",
           "append", "verify", "head", "rows", "canonical", "digest_of"]

LOGIN, LOGIN_FAILED, LOGOUT = "login", "login_failed", "logout"
SUBMIT, STOP, RESUME = "submit", "stop", "resume"
DOWNLOAD_MODEL, DOWNLOAD_CHECKPOINT, DOWNLOAD_EXPORT = "download_model", "download_checkpoint", "download_export"
ACCOUNT_ADD, ACCOUNT_REVOKE, TOKEN_ISSUE, TOKEN_REVOKE = "account_add", "account_revoke", "token_issue", "token_revoke"
POLICY_REFUSAL = "policy_refusal"
#: The closed vocabulary of :attr:`AuditRow.action`.
ACTIONS = (LOGIN, LOGIN_FAILED, LOGOUT, SUBMIT, STOP, RESUME, DOWNLOAD_MODEL, DOWNLOAD_CHECKPOINT, DOWNLOAD_EXPORT,
           ACCOUNT_ADD, ACCOUNT_REVOKE, TOKEN_ISSUE, TOKEN_REVOKE, POLICY_REFUSAL)
#: The ``prev`` of the first row.
GENESIS = "0" * 64
#: The most a row's ``detail`` may take, encoded as in a digest.
MAX_DETAIL_BYTES = 16384
MAX_DEPTH = 32      # nesting of ``detail``: deeper is refused, before json's own recursion limit
MAX_INT_BITS = 256  # an integer in ``detail``: a count or an id, never a bignum
_LIMITS = {"actor": 64, "org": 64, "target": 255}
_PG_LOCK = 0x51_41_75_64  # "QAud": the advisory lock key of an append
_TRIES = 5
CONTENT = "its content does not match its digest"
LINK = "links to a row that is not the one before it"


class AuditError(QuorumError):
    """An audit row was refused (a field too long, an unknown action, a detail that is not plain JSON)."""


class AuditLog(Base):
    """One row of the audit trail, as stored (:class:`AuditRow` is what readers get)."""

    __tablename__ = "audit_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # chosen under the lock
    at: Mapped[float] = mapped_column(Float)
    actor: Mapped[str] = mapped_column(String(64), index=True)
    org: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(32), index=True)
    target: Mapped[str] = mapped_column(String(255))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON)
    prev: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(64))


@dataclass(frozen=True)
class AuditRow:
    """One row of the audit trail: when, who, of which organisation, what, on what, particulars, and its links."""

    id: int
    at: float
    actor: str
    org: str
    action: str
    target: str
    detail: dict[str, Any]
    prev: str
    digest: str


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` found: ``ok``, how many ``rows`` it checked, the first bad row's id and why.

    ``head`` is the newest row's ``(id, digest)`` of an intact, non-empty trail (None otherwise).
    """

    ok: bool
    rows: int
    first_bad: int | None = None
    reason: str = ""
    head: tuple[int, str] | None = None

    @property
    def message(self) -> str:
        """One line: ``audit trail intact: N rows, head ID DIGEST16`` or ``row ID: why``."""
        if not self.ok:
            return f"row {self.first_bad}: {self.reason}"
        if self.head is None:
            return "audit trail intact: 0 rows (nothing recorded yet)"
        return f"audit trail intact: {self.rows} rows, head {self.head[0]} {self.head[1][:16]}"


def canonical(id: int, at: float, actor: str, org: str, action: str, target: str,
              detail: dict[str, Any], prev: str) -> bytes:
    """Return the bytes a row's digest is the SHA-256 of (the encoding in the module docstring).

    Raises
    ------
    ValueError
        A NaN or infinite number, or an integer too long to write.
    TypeError
        Something JSON cannot hold.
    """
    return json.dumps([id, at, actor, org, action, target, detail, prev], sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False).encode("ascii")


def digest_of(id: int, at: float, actor: str, org: str, action: str, target: str,
              detail: dict[str, Any], prev: str) -> str:
    """Return a row's digest: the hex SHA-256 of :func:`canonical`."""
    return hashlib.sha256(canonical(id, at, actor, org, action, target, detail, prev)).hexdigest()


def _checked_text(field: str, value: object, empty_ok: bool = True) -> str:
    if not isinstance(value, str):
        raise AuditError(f"audit {field}: {type(value).__name__} {value!r:.60}, not text")
    if len(value) > _LIMITS.get(field, 32):
        raise AuditError(f"audit {field}: {len(value)} characters, at most {_LIMITS.get(field, 32)} ({value!r:.60})")
    if not value and not empty_ok:
        raise AuditError(f"audit {field}: empty; name who acted (an account, token, cli:USER or device:NAME)")
    if "\x00" in value or any("\ud800" <= c <= "\udfff" for c in value):  # PostgreSQL takes no NUL; UTF-8 no surrogate
        raise AuditError(f"audit {field} {value!r:.60}: a NUL character or a lone surrogate, which the "
                         "database cannot store")
    return value


def _check_value(value: object, where: str, depth: int) -> None:
    """Refuse what JSON cannot hold exactly, naming where in ``detail`` it is."""
    if depth > MAX_DEPTH:
        raise AuditError(f"audit {where}: nested more than {MAX_DEPTH} levels deep")
    if value is None or isinstance(value, bool | str):
        return
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise AuditError(f"audit {where}: an integer of {value.bit_length()} bits, at most {MAX_INT_BITS}")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise AuditError(f"audit {where}: {value!r} is not a finite number (JSON has no NaN or infinity)")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise AuditError(f"audit {where}: key {key!r:.60} is not text ({type(key).__name__})")
            _check_value(item, f"{where}[{key!r:.60}]", depth + 1)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_value(item, f"{where}[{i}]", depth + 1)
    else:
        raise AuditError(f"audit {where}: a {type(value).__name__} is not JSON (text, a number, true/false, "
                         "null, a list or an object)")


def _checked_detail(detail: object) -> dict[str, Any]:
    """Return ``detail`` as the store will give it back (tuples as lists): what its digest is taken over."""
    if detail is None:
        return {}
    if not isinstance(detail, dict):
        raise AuditError(f"audit detail: a {type(detail).__name__}, not a JSON object (a dict with text keys)")
    _check_value(detail, "detail", 0)
    encoded = json.dumps(detail, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    if len(encoded) > MAX_DETAIL_BYTES:
        raise AuditError(f"audit detail: {len(encoded)} bytes encoded, at most {MAX_DETAIL_BYTES}")
    stored: dict[str, Any] = json.loads(encoded)
    if json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=True) != encoded:
        raise AuditError("audit detail: two keys of one object read back alike (a surrogate pair spelt two ways)")
    return stored


def append(store: RunStore, actor: str, action: str, target: str = "", org: str = "",
           detail: dict[str, Any] | None = None) -> AuditRow:
    """Append one row to the audit trail, dated by the store's clock, chained to the newest row; return it.

    Raises
    ------
    AuditError
        An empty or over-long actor, an over-long organisation or target
        (64, 64 and 255 characters), text with a NUL or a lone surrogate, an
        action not in :data:`ACTIONS`, or a detail that is not a JSON object
        of text keys, finite numbers and integers of at most 256 bits, nested
        at most 32 deep and 16 KiB encoded (the message names the key).
    """
    if action not in ACTIONS:
        raise AuditError(f"audit action {action!r:.60}: one of {', '.join(ACTIONS)}")
    fields = {"actor": _checked_text("actor", actor, empty_ok=False), "org": _checked_text("org", org),
              "action": action, "target": _checked_text("target", target), "detail": _checked_detail(detail)}
    lost = 0
    while True:
        try:
            return _append_once(store, fields)
        except IntegrityError:  # another writer took the id: a database where neither lock below applies
            lost += 1
            if lost == _TRIES:
                raise AuditError(f"audit: lost the race for the next id {_TRIES} times in a row; "
                                 "another process is writing the trail") from None


def _append_once(store: RunStore, fields: dict[str, Any]) -> AuditRow:
    with store.session() as s, s.begin():
        _lock(s)
        at = float(store.clock())  # under the lock: times rise along the chain with the clock
        if not math.isfinite(at):
            raise AuditError(f"audit time {at!r}: the store's clock gave no finite time")
        newest = s.execute(select(AuditLog.id, AuditLog.digest).order_by(AuditLog.id.desc()).limit(1)).first()
        row_id, prev = (int(newest.id) + 1, str(newest.digest)) if newest is not None else (1, GENESIS)
        digest = digest_of(row_id, at, fields["actor"], fields["org"], fields["action"], fields["target"],
                           fields["detail"], prev)
        s.add(AuditLog(id=row_id, at=at, prev=prev, digest=digest, **fields))
    return AuditRow(id=row_id, at=at, prev=prev, digest=digest, **fields)


def _lock(s: Session) -> None:
    """Hold the trail's append lock until the transaction ends, before the newest row is read."""
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_LOCK})
    else:
        # SQLite's driver begins a transaction at its first write: an UPDATE that changes nothing takes the
        # database's write lock now, so a second appender waits here (busy timeout) rather than read the same head
        s.execute(text("UPDATE audit_log SET id = id WHERE id < 0"))


#: Every column as stored, read untyped (``_stream``); ``detail`` as its text: a tampered one need not be JSON.
_RAW = select(AuditLog.id, AuditLog.at, AuditLog.actor, AuditLog.org, AuditLog.action, AuditLog.target,
              cast(AuditLog.detail, Text).label("detail"), AuditLog.prev, AuditLog.digest)


def _stream(store: RunStore, query: Executable) -> Generator[Any, None, None]:
    """Yield ``query``'s rows; text that is no UTF-8 (an SQLite file edited by hand) read with surrogates."""
    with store.engine.connect() as connection:
        driver: Any = connection.connection.driver_connection
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:
            driver.text_factory = lambda data: data.decode("utf-8", "surrogateescape")
        try:
            with connection.execution_options(yield_per=1000).execute(query) as result:  # a server cursor, closed
                yield from result
        except DBAPIError as exc:
            raise AuditError(f"the audit trail cannot be read: {exc.orig}") from None
        finally:
            if sqlite:
                driver.text_factory = str


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _parsed_detail(raw_text: object) -> dict[str, Any]:
    """Parse a stored detail strictly (no NaN); ValueError when it is not a JSON object."""
    if not isinstance(raw_text, str):
        raise ValueError("no detail")
    try:
        detail = json.loads(raw_text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(detail, dict):
        raise ValueError("not an object")
    return detail


def _recomputed(raw: Any) -> str | None:
    """Return the digest ``raw`` should carry; None when a column no longer holds what append wrote (its type)."""
    texts = (raw.actor, raw.org, raw.action, raw.target, raw.prev)
    if not isinstance(raw.id, int) or not isinstance(raw.at, float) or not all(isinstance(t, str) for t in texts):
        return None
    try:
        return digest_of(raw.id, raw.at, raw.actor, raw.org, raw.action, raw.target, _parsed_detail(raw.detail),
                         raw.prev)
    except (ValueError, TypeError):
        return None


def _fault(raw: Any, prev: Any) -> str | None:
    """Why ``raw`` breaks the chain after ``prev`` (None for the first row); None when it does not."""
    if _recomputed(raw) != raw.digest:
        return CONTENT
    if raw.prev != (prev.digest if prev is not None else GENESIS):
        return LINK
    expected = prev.id + 1 if prev is not None else 1
    if raw.id != expected:
        return f"its id is not {expected}, " + (f"the one after row {prev.id}" if prev is not None else "the first's")
    return None


def verify(store: RunStore) -> Verification:
    """Check every row's digest and link, oldest first, in one read; name the first row that fails.

    The read is one statement: rows appended meanwhile are either all in it or
    none. Reasons: ``its content does not match its digest`` (a column
    changed, the digest too), ``links to a row that is not the one before it``
    (a row deleted or inserted before it), or an id out of sequence.

    Raises
    ------
    AuditError
        The database cannot read the table at all (a file damaged past reading).
    """
    checked, previous = 0, None
    with closing(_stream(store, _RAW.order_by(AuditLog.id))) as stream:  # its cursor closed at the first bad row
        for raw in stream:
            checked += 1
            reason = _fault(raw, previous)
            if reason is not None:
                return Verification(ok=False, rows=checked, first_bad=raw.id, reason=reason)
            previous = raw
    return Verification(ok=True, rows=checked, head=(previous.id, previous.digest) if previous else None)


def head(store: RunStore) -> tuple[int, str] | None:
    """Return the newest row's ``(id, digest)``, to publish where the database's writers cannot change it."""
    with store.session() as s:
        newest = s.execute(select(AuditLog.id, AuditLog.digest).order_by(AuditLog.id.desc()).limit(1)).first()
    return (int(newest.id), str(newest.digest)) if newest is not None else None


def _as_row(raw: Any) -> AuditRow:
    """``raw`` for showing: whatever a tampered row holds is shown, never raised."""
    try:
        detail = _parsed_detail(raw.detail)
    except ValueError:
        detail = {"unreadable": str(raw.detail)[:200]}
    at = float(raw.at) if isinstance(raw.at, int | float) else math.nan
    return AuditRow(id=int(raw.id), at=at, actor=_shown(raw.actor), org=_shown(raw.org), action=_shown(raw.action),
                    target=_shown(raw.target), detail=detail, prev=_shown(raw.prev), digest=_shown(raw.digest))


def _shown(value: object) -> str:
    """``value`` as printable text: what no UTF-8 can hold (a row edited by hand) escaped."""
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


def rows(store: RunStore, limit: int = 50, action: str | None = None, actor: str | None = None) -> list[AuditRow]:
    """Return the newest ``limit`` rows, newest first; only ``action``'s, or ``actor``'s, when given.

    Raises
    ------
    AuditError
        A limit below 1, an action not in :data:`ACTIONS`, or a table the database cannot read.
    """
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise AuditError(f"audit rows: limit {limit!r} is not a positive integer")
    if action is not None and action not in ACTIONS:
        raise AuditError(f"audit action {action!r:.60}: one of {', '.join(ACTIONS)}")
    query = _RAW.order_by(AuditLog.id.desc()).limit(limit)
    if action is not None:
        query = query.where(AuditLog.action == action)
    if actor is not None:
        query = query.where(AuditLog.actor == actor)
    return [_as_row(raw) for raw in _stream(store, query)]
