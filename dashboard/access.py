"""Who is asking, and what they may see: accounts and roles on every route of the dashboard.

A request acts for a :class:`runstore.accounts.Principal`, found in this order:

1. an account's API token (``qrm_...``), as ``Authorization: Bearer``, or once
   as ``?token=`` (which sets a session cookie holding the token's SHA-256,
   never the token; a page is redirected to its address without it);
2. the dashboard's single shared token (``--token``), as before: ``admin``;
3. nothing, on a dashboard with no shared token whose store has no live
   account: the one-person loopback setup, ``admin`` (``LoopbackHostGuard``
   keeps it to loopback ``Host`` headers).

Anything else is 401. Then every route has a rule (:data:`RULES`, by its path
template; a route without one is refused, and ``tests/dashboard/test_access.py``
fails on it): which roles may call it at all. What a role sees inside an
allowed route is the handlers' part: per-client rows only of the account's
own organisation's devices (:class:`ScopedReader`), a checkpoint only for an
``admin`` or the lead who submitted its run (:func:`may_download`).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qsl, urlencode

from sqlalchemy.exc import SQLAlchemyError
from starlette.routing import BaseRoute, Match

from core.errors import QuorumError
from dashboard.auth import COOKIE, ASGIApp, Message, Receive, Scope, Send
from runstore.accounts import Principal, authenticate, authenticate_digest, has_live_accounts, token_digest
from runstore.audit import LOGIN, LOGIN_FAILED, RESUME, STOP, SUBMIT, append

__all__ = ["RULES", "WRITES", "READ", "ANYONE", "CSRF_HEADER", "Buckets", "rule_of", "AccessGuard", "principal_of",
           "ScopedReader", "may_download", "SESSION_COOKIE", "LOCAL", "SHARED", "route_template", "record",
           "iter_routes", "AUDITED_WRITES"]

SESSION_COOKIE = "quorum_session"
#: The one-person setup (loopback, no token, no account) and the shared token: both may do everything.
LOCAL = Principal(name="local", org="", role="admin")
SHARED = Principal(name="token", org="", role="admin")
#: Roles that may read runs, rounds and the pages.
READ = frozenset({"admin", "lead", "member"})
#: The rule of a route that anyone may call, before logging in (a login page, an identity provider's callback).
ANYONE = frozenset({"anyone"})
#: Every route of the dashboard, by path template: the roles that may call it. Static files are public.
RULES: dict[str, frozenset[str]] = {
    # pages
    "/": READ, "/runs": READ, "/runs/{run_id}": READ, "/runs/{run_id}/rounds/{number}": READ,
    "/clients": READ, "/clients/{client}": READ, "/docs": READ,
    # the JSON API (its per-client rows filtered by organisation, ScopedReader)
    "/openapi.json": READ,
    "/api/runs": READ, "/api/runs/{run_id}": READ, "/api/runs/{run_id}/rounds": READ,
    "/api/runs/{run_id}/rounds/{number}": READ, "/api/runs/{run_id}/rounds/{number}/clients": READ,
    "/api/runs/{run_id}/log": READ, "/api/runs/{run_id}/events": READ, "/api/events": READ,
    "/api/runs/{run_id}/metrics.csv": READ,
    "/api/clients": READ, "/api/clients/{client}": READ,
    # models: an admin, or the lead whose run it is (may_download)
    "/api/runs/{run_id}/checkpoint": frozenset({"admin", "lead"}),
    # Prometheus: every client's figures of every run
    "/metrics": frozenset({"admin", "service"}),
    # logging in at the organisation's identity provider, and out (dashboard/login.py)
    "/auth/login": ANYONE, "/auth/callback": ANYONE, "/auth/logout": ANYONE,
    # how a remote submission went (dashboard/submit.py: the submitter's own, or any for an admin)
    "/api/submissions/{submission}": frozenset({"admin", "lead"}),
}
#: Routes that change something, by ``METHOD template``: the roles that may call them (a package that adds a
#: write route adds its rule here). Cookie sessions must send :data:`CSRF_HEADER` with them.
WRITES: dict[str, frozenset[str]] = {
    # a plain form ends the browser's own session (dashboard/login.py checks its Origin instead of the header)
    "POST /auth/logout": ANYONE,
    # remote run submission (dashboard/submit.py): queued for the leading aggregator
    "POST /api/runs": frozenset({"admin", "lead"}), "POST /api/runs/{run_id}/stop": frozenset({"admin", "lead"}),
    "POST /api/runs/{run_id}/resume": frozenset({"admin", "lead"}),
}
#: Write routes whose every attempt goes to the audit trail, refused ones too (a role, a missing CSRF header).
AUDITED_WRITES: dict[str, str] = {"POST /api/runs": SUBMIT, "POST /api/runs/{run_id}/stop": STOP,
                                  "POST /api/runs/{run_id}/resume": RESUME}
#: What a write through a cookie session must carry: a header a page of another site cannot make a browser send
#: (it would need this server's CORS consent, never given). A bearer token is not sent by a browser on its own.
CSRF_HEADER = ("x-requested-with", "quorum")
#: Writes per account: a burst of this many, refilled at WRITE_RATE per second (429 past it).
WRITE_BURST, WRITE_RATE = 10, 0.5
READ_METHODS = ("GET", "HEAD")
PUBLIC_PREFIXES = ("/static/",)
_ACCOUNTS_TTL_S = 2.0


def route_template(routes: Iterable[BaseRoute], scope: Scope) -> str | None:
    """Return the path template of the first route that matches ``scope``'s path (any method), else None."""
    for route in routes:
        match, _ = route.matches(scope)
        if match != Match.NONE:
            return str(getattr(route, "path", ""))
    return None


def rule_of(method: str, template: str) -> frozenset[str] | None:
    """Return the roles that may call ``method`` on ``template`` (:data:`RULES` for reads, :data:`WRITES` else)."""
    return RULES.get(template) if method in READ_METHODS else WRITES.get(f"{method} {template}")


def _has_csrf_header(scope: Scope) -> bool:
    name, value = CSRF_HEADER
    presented: bytes = dict(scope.get("headers", [])).get(name.encode(), b"")
    return presented.decode("latin-1").strip().lower() == value


class Buckets:
    """One token bucket per key: ``burst`` at once, refilled at ``rate`` per second."""

    def __init__(self, burst: float, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.rate, self.clock = burst, rate, clock
        self._level: dict[str, tuple[float, float]] = {}

    def take(self, key: str) -> bool:
        """Take one token for ``key``; False when its bucket is empty."""
        now = self.clock()
        level, then = self._level.get(key, (self.burst, now))
        level = min(self.burst, level + (now - then) * self.rate)
        if level < 1:
            self._level[key] = (level, now)
            return False
        self._level[key] = (level - 1, now)
        return True


def principal_of(request: Any) -> Principal:
    """Return the principal :class:`AccessGuard` found for ``request`` (``LOCAL`` without the guard)."""
    found = request.scope.get("state", {}).get("principal")
    return found if isinstance(found, Principal) else LOCAL


def _digest(token: str) -> str:
    """Return the shared token's session cookie value (``dashboard.auth.COOKIE``): a hash, never the token."""
    return hashlib.sha256(f"quorum-dashboard:{token}".encode()).hexdigest()


class AccessGuard:
    """ASGI middleware: find the request's principal, then apply its route's rule (see the module docstring).

    ``store`` is the run store (``runstore.store.RunStore``) the accounts live in; ``routes``
    the routes whose templates :data:`RULES` names; ``unauthorized`` builds the 401 answer.
    """

    def __init__(self, app: ASGIApp, store: Any, routes: Sequence[BaseRoute], token: str | None,
                 unauthorized: Callable[[Scope], ASGIApp], forbidden: Callable[[Scope, str], ASGIApp],
                 too_many: Callable[[Scope], ASGIApp] | None = None, open_local: bool = True) -> None:
        self.app = app
        self.open_local = open_local  # False: never LOCAL, even with no account left (``--accounts``)
        self.store = store
        self.routes = routes
        self.token = token
        self.shared_cookie = _digest(token) if token else None
        self.unauthorized = unauthorized
        self.forbidden = forbidden
        self.too_many = too_many or _too_many
        self._accounts: tuple[float, bool] = (0.0, False)
        self._writes = Buckets(WRITE_BURST, WRITE_RATE)

    def _has_accounts(self) -> bool:
        """Return whether the store has a live account (looked up at most every 2 s)."""
        checked, found = self._accounts
        now = time.monotonic()
        if now - checked >= _ACCOUNTS_TTL_S:
            found = has_live_accounts(self.store)
            self._accounts = (now, found)
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Authenticate, check the route's rule, then pass the request on with ``state.principal`` set."""
        if scope["type"] != "http" or scope["path"].startswith(PUBLIC_PREFIXES):
            await self.app(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        from_query = next((v for k, v in query if k == "token"), None)
        cookie: bytes | None = None
        principal, presented = self._from_headers(scope)
        if from_query is not None and principal is None:
            presented = "query"
            principal, cookie = self._from_query(from_query)
            if principal is not None:
                record(self.store, LOGIN, principal, path=scope["path"])
        if principal is None and presented is not None:
            record(self.store, LOGIN_FAILED, None, presented=presented, path=scope["path"][:200])
        if principal is None and self.token is None and self.open_local and not self._has_accounts():
            principal = LOCAL
        template = route_template(self.routes, scope)
        method = str(scope.get("method", "GET")).upper()
        if template is not None and rule_of(method, template) is ANYONE:
            if principal is not None:
                scope.setdefault("state", {})["principal"] = principal
            await self.app(scope, receive, send)
            return
        if principal is None:
            await self.unauthorized(scope)(scope, receive, send)
            return
        if template is not None:
            allowed = rule_of(method, template)
            why = None
            if allowed is None or principal.role not in allowed:
                why = (f"role {principal.role!r} may not {method} {template}" if allowed is not None
                       else f"{method} {template} has no access rule")
            elif method not in READ_METHODS and presented == "cookie" and not _has_csrf_header(scope):
                why = f"a change through a session cookie needs the header {CSRF_HEADER[0]}: {CSRF_HEADER[1]}"
            if why is not None:
                self._record_refusal(scope, method, template, principal, why)
                await self.forbidden(scope, why)(scope, receive, send)
                return
            if method not in READ_METHODS and not self._writes.take(principal.name):
                await self.too_many(scope)(scope, receive, send)
                return
        scope.setdefault("state", {})["principal"] = principal
        if cookie is None:
            await self.app(scope, receive, send)
        else:
            await self._with_cookie(scope, receive, send, cookie, [(k, v) for k, v in query if k != "token"])

    def _record_refusal(self, scope: Scope, method: str, template: str, principal: Principal, why: str) -> None:
        """Record a refused attempt at an audited write route (:data:`AUDITED_WRITES`); best effort."""
        action = AUDITED_WRITES.get(f"{method} {template}")
        if action is not None:
            record(self.store, action, principal, target=scope["path"][:255], allowed=False, status=403, reason=why)

    def _from_headers(self, scope: Scope) -> tuple[Principal | None, str | None]:
        """Return the principal of the request's bearer token or cookie, and which of them it presented."""
        headers = dict(scope.get("headers", []))
        auth = headers.get(b"authorization", b"").decode("latin-1")
        if auth[:7].lower() == "bearer ":
            presented = auth[7:].strip()
            if self.token is not None and hmac.compare_digest(presented.encode("latin-1"), self.token.encode()):
                return SHARED, "bearer"
            return authenticate(self.store, presented), "bearer"
        jar = SimpleCookie()
        try:
            jar.load(headers.get(b"cookie", b"").decode("latin-1"))
        except CookieError:  # a malformed cookie header is just "no credentials"
            return None, None
        shared = jar.get(COOKIE)
        if shared is not None and self.shared_cookie is not None and hmac.compare_digest(
                shared.value.encode("latin-1"), self.shared_cookie.encode()):
            return SHARED, "cookie"
        session = jar.get(SESSION_COOKIE)
        if session is None:
            return None, "cookie" if shared is not None else None
        return authenticate_digest(self.store, session.value), "cookie"

    def _from_query(self, presented: str) -> tuple[Principal | None, bytes | None]:
        if self.token is not None and hmac.compare_digest(presented.encode("latin-1", "replace"),
                                                          self.token.encode()):
            return SHARED, f"{COOKIE}={self.shared_cookie}".encode()
        found = authenticate(self.store, presented)
        return (found, f"{SESSION_COOKIE}={token_digest(presented)}".encode()) if found else (None, None)

    async def _with_cookie(self, scope: Scope, receive: Receive, send: Send, cookie: bytes,
                           rest: list[tuple[str, str]]) -> None:
        """Set the session cookie; a page GET is redirected to its address without the token."""
        secure = b"; Secure" if scope.get("scheme") in ("https", "wss") else b""
        header = cookie + b"; Path=/; HttpOnly; SameSite=Strict" + secure
        if scope["method"] == "GET" and not scope["path"].startswith(("/api/", "/metrics")):
            location = scope.get("root_path", "") + scope["path"] + (f"?{urlencode(rest)}" if rest else "")
            await send({"type": "http.response.start", "status": 303,
                        "headers": [(b"location", location.encode()), (b"set-cookie", header),
                                    (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return

        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"set-cookie", header)]
            await send(message)

        await self.app(scope, receive, send_with_cookie)


def record(store: Any, action: str, principal: Principal | None, required: bool = False, target: str = "",
           **detail: Any) -> bool:
    """Append ``action`` by ``principal`` to the audit trail (``runstore/audit.py``); whether it was written.

    Logins and failed logins are best effort (a store the dashboard may not
    write to still serves); with ``required`` (a model download) the error
    propagates, so what cannot be recorded is not done.
    """
    who = principal or Principal(name="anonymous", org="", role="")
    try:
        append(store, who.name, action, target=target, org=who.org, detail=detail)
    except (QuorumError, SQLAlchemyError):
        if required:
            raise
        return False
    return True


def _too_many(_scope: Scope) -> ASGIApp:
    async def answer(_scope: Scope, _receive: Receive, send: Send) -> None:
        body = b'{"detail": "too many changes: wait a few seconds"}'
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"2"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
    return answer


def _device_orgs(info: dict[str, Any] | None) -> dict[str, str]:
    """Map client id -> organisation of a deployed run's devices (``info["devices"]`` and ``info["orgs"]``)."""
    info = info or {}
    devices, orgs = info.get("devices"), info.get("orgs")
    if not isinstance(devices, dict) or not isinstance(orgs, dict):
        return {}
    return {str(node): str(orgs[name]) for node, name in devices.items() if isinstance(name, str) and name in orgs}


class ScopedReader:
    """A ``dashboard.queries.Reader`` that shows per-client rows of the principal's own organisation only.

    An ``admin`` sees every row. Another role sees a client's rows only where
    the run recorded that client's device as its organisation's
    (``info["orgs"]``); a client of no known organisation (a simulation's,
    a device enrolled without one) is seen by admins alone. Everything else is
    the reader's own.
    """

    def __init__(self, reader: Any, principal: Principal) -> None:
        self._reader = reader
        self.principal = principal

    def __getattr__(self, name: str) -> Any:
        """Everything but the per-client queries is the reader's own."""
        return getattr(self._reader, name)

    @property
    def scoped(self) -> bool:
        """Return whether rows are filtered (not an admin)."""
        return not self.principal.is_admin

    def _own(self, run_ids: Iterable[str]) -> dict[str, set[str]]:
        """Map run id -> the client ids of the principal's organisation in it."""
        own: dict[str, set[str]] = {}
        for run_id in set(run_ids):
            found = self._reader.run(run_id)
            orgs = _device_orgs(found[0].info if found else None)
            own[run_id] = {client for client, org in orgs.items() if org == self.principal.org}
        return own

    def _visible(self, rows: Sequence[Any]) -> list[Any]:
        if not self.scoped:
            return list(rows)
        own = self._own(r.run_id for r in rows)
        return [r for r in rows if r.client in own.get(r.run_id, set())]

    def round_clients(self, run_id: str, number: int) -> list[Any]:
        """Return the round's client rows the principal may see."""
        return self._visible(self._reader.round_clients(run_id, number))

    def client_history(self, client: str, run_id: str | None = None, limit: int = 1000) -> list[Any]:
        """Return the client's rows the principal may see."""
        return self._visible(self._reader.client_history(client, run_id, limit))

    def _own_clients(self, runs: str | Sequence[str] | None) -> set[str]:
        ids = [runs] if isinstance(runs, str) else list(runs) if runs is not None else [
            r.id for r, _ in self._reader.runs()]
        return set().union(*self._own(ids).values()) if ids else set()

    def clients(self, runs: str | Sequence[str] | None = None, limit: int | None = None, offset: int = 0,
                public: bool = False) -> list[Any]:
        """Return the client summaries the principal may see (paged after the organisation's filter)."""
        if not self.scoped:
            return list(self._reader.clients(runs, limit, offset, public=public))
        own = self._own_clients(runs)
        rows = [c for c in self._reader.clients(runs, None, 0, public=public) if c.client in own]
        return rows[offset:None if limit is None else offset + limit]

    def count_clients(self, runs: str | Sequence[str] | None = None, public: bool = False) -> int:
        """Return how many clients :meth:`clients` would list."""
        if not self.scoped:
            return int(self._reader.count_clients(runs, public=public))
        return len(self.clients(runs, public=public))


def may_download(principal: Principal, run_info: dict[str, Any] | None) -> bool:
    """Return whether ``principal`` may download a run's model: an admin, or the lead that submitted it."""
    if principal.is_admin:
        return True
    submitted_by = (run_info or {}).get("submitted_by")
    return principal.role == "lead" and isinstance(submitted_by, str) and submitted_by == principal.name


def iter_routes(routes: Iterable[Any]) -> Iterator[Any]:
    """Every route under ``routes``, routers included by FastAPI flattened (for the rules' test)."""
    for route in routes:
        nested = getattr(route, "effective_candidates", None)
        if callable(nested):
            yield from iter_routes(nested())
        elif getattr(route, "routes", None) and not getattr(route, "path", ""):
            yield from iter_routes(route.routes)
        else:
            yield route
