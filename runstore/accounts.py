"""Accounts, roles and API tokens, kept in the run store: who may do what on the dashboard.

An account belongs to an organisation (a site: the devices it enrolled under
that name) and has one role:

* ``admin``: everything, accounts too;
* ``lead``: submits, stops and resumes runs; downloads the models of the runs it submitted;
* ``member``: views runs; per-client rows of its own organisation's devices only;
* ``service``: a read-only token for a scraper (Prometheus): ``/metrics`` only.

A token is ``qrm_`` and 43 characters of ``secrets.token_urlsafe(32)`` (256
bits): only its SHA-256 is stored (a random secret of that size needs no slow
hash; the dashboard checks it on every request), with its first 12 characters
to tell tokens apart in ``quorum accounts list``. Tokens expire (90 days by
default) and are revoked with their account or one by one.

An account may be linked to one identity at an OpenID provider, its issuer
and subject (``sub``): a login there (``dashboard/login.py``) opens a browser
session, a token row of its own (``qrs_``, 8 hours by default) whose secret
nobody ever sees: the session cookie holds its SHA-256, as a ``?token=``
login's does, and logging out revokes it.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sqlalchemy import Float, ForeignKey, Integer, String, select, update
from sqlalchemy.orm import Mapped, mapped_column

from core.errors import QuorumError
from runstore.base import Base

if TYPE_CHECKING:
    from runstore.store import RunStore

__all__ = ["ROLES", "AccountError", "AccountRow", "TokenRow", "Principal", "add_account", "list_accounts",
           "revoke_account", "issue_token", "revoke_token", "authenticate", "authenticate_digest",
           "has_live_accounts", "token_digest", "TOKEN_PREFIX", "DEFAULT_TOKEN_DAYS", "check_days",
           "account_for_identity", "issue_session", "end_session", "SESSION_PREFIX", "DEFAULT_SESSION_HOURS"]

ROLES = ("admin", "lead", "member", "service")
TOKEN_PREFIX = "qrm_"
DEFAULT_TOKEN_DAYS = 90.0
MAX_TOKEN_DAYS = 3650.0
SESSION_PREFIX = "qrs_"
DEFAULT_SESSION_HOURS = 8.0
MAX_SESSION_HOURS = 24.0 * 30
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
_TOKEN = re.compile(r"qrm_[A-Za-z0-9_-]{43}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_ISSUER = re.compile(r"https?://[^\s?#]{1,240}")
_SUBJECT = re.compile(r"[\x21-\x7e]{1,255}")  # OpenID Connect: at most 255 ASCII characters; printable here


class AccountError(QuorumError):
    """An account command was given a bad name, role, organisation or lifetime, or names no account."""


class AccountRow(Base):
    """One account: its unique name, organisation and role; OIDC issuer and subject once it logged in that way."""

    __tablename__ = "accounts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    org: Mapped[str] = mapped_column(String(64), index=True)
    role: Mapped[str] = mapped_column(String(16))
    issuer: Mapped[str | None] = mapped_column(String(255), nullable=True)
    subject: Mapped[str | None] = mapped_column(String(255), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class TokenRow(Base):
    """One API token of an account: the SHA-256 of the secret, never the secret."""

    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    account_id: Mapped[int] = mapped_column(ForeignKey("accounts.id"), index=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    shown: Mapped[str] = mapped_column(String(16))  # the token's first 12 characters
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: an account's name, organisation and role (``admin`` for the single shared token)."""

    name: str
    org: str
    role: str

    @property
    def is_admin(self) -> bool:
        """Whether it may do everything (the ``admin`` role)."""
        return self.role == "admin"


def token_digest(token: str) -> str:
    """Return the hex SHA-256 stored for ``token``."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def _check_name(what: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise AccountError(f"{what} {value!r}: 1-64 characters, letters, digits and . _ @ - (starting with a "
                           "letter or digit)")
    return value


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise AccountError(f"role {role!r}: one of {', '.join(ROLES)}")
    return role


def check_days(days: float) -> float:
    """Return ``days`` as a token lifetime, or raise :class:`AccountError` unless it is in (0, 3650]."""
    if not isinstance(days, int | float) or not 0 < days <= MAX_TOKEN_DAYS:  # NaN fails both comparisons
        raise AccountError(f"token lifetime {days!r} days: more than 0, at most {MAX_TOKEN_DAYS:g}")
    return float(days)


def _check_identity(issuer: str | None, subject: str | None) -> None:
    if (issuer is None) != (subject is None):
        raise AccountError("give both the OpenID issuer and the subject of the account's identity, or neither")
    if issuer is not None and (not isinstance(issuer, str) or not _ISSUER.fullmatch(issuer)):
        raise AccountError(f"OpenID issuer {issuer!r}: its URL, http(s)://..., as the provider names itself")
    if subject is not None and (not isinstance(subject, str) or not _SUBJECT.fullmatch(subject)):
        raise AccountError(f"OpenID subject {subject!r}: 1-255 printable ASCII characters, no spaces "
                           "(the `sub` claim of the account's ID tokens)")


def add_account(store: RunStore, name: str, org: str, role: str, issuer: str | None = None,
                subject: str | None = None) -> AccountRow:
    """Create an account, linked to the OpenID identity ``(issuer, subject)`` when both are given.

    Raises
    ------
    AccountError
        A bad name, organisation, role or identity, an account of that name
        exists already, or another account has that identity.
    """
    _check_name("account", name)
    _check_name("organisation", org)
    _check_role(role)
    _check_identity(issuer, subject)
    with store.session() as s, s.begin():
        if s.scalar(select(AccountRow).where(AccountRow.name == name)) is not None:
            raise AccountError(f"account {name!r} exists already (quorum accounts list)")
        if issuer is not None and (other := s.scalar(select(AccountRow.name).where(
                AccountRow.issuer == issuer, AccountRow.subject == subject))) is not None:
            raise AccountError(f"the identity {subject!r} of {issuer} is account {other!r}'s already")
        row = AccountRow(name=name, org=org, role=role, issuer=issuer, subject=subject, created_at=time.time())
        s.add(row)
        s.flush()
        s.expunge(row)
    return row


def list_accounts(store: RunStore) -> list[tuple[AccountRow, list[TokenRow]]]:
    """Every account, by name, with its tokens (oldest first)."""
    with store.session() as s:
        accounts = list(s.scalars(select(AccountRow).order_by(AccountRow.name)))
        tokens = list(s.scalars(select(TokenRow).order_by(TokenRow.id)))
        s.expunge_all()
    return [(a, [t for t in tokens if t.account_id == a.id]) for a in accounts]


def _account(s: object, name: str) -> AccountRow:
    row = s.scalar(select(AccountRow).where(AccountRow.name == name))  # type: ignore[attr-defined]
    if row is None:
        raise AccountError(f"no account {name!r} (quorum accounts list)")
    return row  # type: ignore[no-any-return]


def revoke_account(store: RunStore, name: str) -> int:
    """Revoke an account and every token it has; return how many tokens were live.

    Raises
    ------
    AccountError
        No such account.
    """
    now = time.time()
    with store.session() as s, s.begin():
        account = _account(s, name)
        if account.revoked_at is None:
            account.revoked_at = now
        done = s.execute(update(TokenRow).where(TokenRow.account_id == account.id, TokenRow.revoked_at.is_(None))
                         .values(revoked_at=now))
    return int(done.rowcount or 0)  # type: ignore[attr-defined]


def issue_token(store: RunStore, name: str, days: float = DEFAULT_TOKEN_DAYS) -> str:
    """Issue a new API token for account ``name``, valid ``days``; the secret is returned once, never stored.

    Raises
    ------
    AccountError
        No such account, a revoked one, or a lifetime out of (0, 3650] days.
    """
    check_days(days)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = time.time()
    with store.session() as s, s.begin():
        account = _account(s, name)
        if account.revoked_at is not None:
            raise AccountError(f"account {name!r} is revoked: add a new account")
        s.add(TokenRow(account_id=account.id, digest=token_digest(token), shown=token[:12], created_at=now,
                       expires_at=now + days * 86400.0))
    return token


def revoke_token(store: RunStore, shown: str) -> str:
    """Revoke the live token whose first characters are ``shown`` (as ``list`` prints them); return its account.

    Raises
    ------
    AccountError
        No live token starts so, or several do.
    """
    if not isinstance(shown, str) or len(shown) < 8:
        raise AccountError(f"token {shown!r}: give at least its first 8 characters, as quorum accounts list shows")
    with store.session() as s, s.begin():
        live = [t for t in s.scalars(select(TokenRow).where(TokenRow.revoked_at.is_(None)))
                if t.shown.startswith(shown[:12]) and (len(shown) <= 12 or t.digest == token_digest(shown))]
        if len(live) != 1:
            raise AccountError(f"token {shown!r}: {'no live token starts so' if not live else 'several do'}")
        live[0].revoked_at = time.time()
        account = s.get(AccountRow, live[0].account_id)
        return account.name if account else "?"


def authenticate(store: RunStore, token: str, now: float | None = None) -> Principal | None:
    """Return the account a presented token acts for; None for anything else.

    Anything else: not a token's shape (checked before any query), unknown,
    expired, revoked, or of a revoked account.
    """
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        return None
    return authenticate_digest(store, token_digest(token), now)


def authenticate_digest(store: RunStore, digest: str, now: float | None = None) -> Principal | None:
    """As :func:`authenticate`, from the token's SHA-256 (what a session cookie holds)."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        return None
    now = time.time() if now is None else now
    with store.session() as s:
        found = s.execute(select(TokenRow, AccountRow).join(AccountRow, AccountRow.id == TokenRow.account_id)
                          .where(TokenRow.digest == digest)).first()
    if found is None:
        return None
    tok, account = found
    if tok.revoked_at is not None or account.revoked_at is not None or tok.expires_at <= now:
        return None
    return Principal(name=account.name, org=account.org, role=account.role)


def has_live_accounts(store: RunStore) -> bool:
    """Whether the store has an account that is not revoked (then every dashboard request needs a token)."""
    with store.session() as s:
        return s.scalar(select(AccountRow.id).where(AccountRow.revoked_at.is_(None)).limit(1)) is not None


def account_for_identity(store: RunStore, issuer: str, subject: str) -> AccountRow | None:
    """Return the account linked to the OpenID identity ``(issuer, subject)``, revoked or not; None if none is."""
    with store.session() as s:
        found = list(s.scalars(select(AccountRow).where(AccountRow.issuer == issuer, AccountRow.subject == subject)
                               .order_by(AccountRow.id).limit(2)))
        s.expunge_all()
    return found[0] if len(found) == 1 else None  # two (a race past add_account's check): neither is trusted


def issue_session(store: RunStore, name: str, hours: float = DEFAULT_SESSION_HOURS) -> str:
    """Open a browser session for account ``name``, valid ``hours``; return its digest, the session cookie's value.

    The session is a token row whose secret (``qrs_...``) is thrown away: the
    digest alone is what a cookie presents (``authenticate_digest``).

    Raises
    ------
    AccountError
        No such account, a revoked one, or a lifetime out of (0, 720] hours.
    """
    if not isinstance(hours, int | float) or not 0 < hours <= MAX_SESSION_HOURS:
        raise AccountError(f"session lifetime {hours!r} hours: more than 0, at most {MAX_SESSION_HOURS:g}")
    secret = SESSION_PREFIX + secrets.token_urlsafe(32)
    digest = token_digest(secret)
    now = time.time()
    with store.session() as s, s.begin():
        account = _account(s, name)
        if account.revoked_at is not None:
            raise AccountError(f"account {name!r} is revoked")
        s.add(TokenRow(account_id=account.id, digest=digest, shown=secret[:12], created_at=now,
                       expires_at=now + hours * 3600.0))
    return digest


def end_session(store: RunStore, digest: str) -> str | None:
    """Revoke the browser session whose cookie holds ``digest``; return its account's name (None: no live session).

    Only sessions are revoked: the cookie of a ``?token=`` login holds an API
    token's digest, and logging out of the browser must not revoke the token.
    """
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        return None
    with store.session() as s, s.begin():
        row = s.scalar(select(TokenRow).where(TokenRow.digest == digest))
        if row is None or row.revoked_at is not None or not row.shown.startswith(SESSION_PREFIX):
            return None
        row.revoked_at = time.time()
        account = s.get(AccountRow, row.account_id)
        return account.name if account else None
