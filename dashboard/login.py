"""Logging in at an identity provider, and out: ``/auth/login``, ``/auth/callback``, ``/auth/logout``.

``GET /auth/login`` sends the browser to the provider with a fresh ``state``,
``nonce`` and PKCE verifier, kept here for 10 minutes (in this process: a
login started before a restart is started again) and bound to the browser by
a cookie holding the ``state``. ``GET /auth/callback`` takes the provider's
answer only with that cookie, once, exchanges the code, verifies the ID
token (``dashboard.oidc``) and looks up the account linked to its issuer and
subject (``quorum accounts add ... --oidc-issuer --oidc-subject``). It then
opens a session (``runstore.accounts.issue_session``): the ``quorum_session``
cookie that ``dashboard.access.AccessGuard`` accepts (HttpOnly; SameSite=Lax,
so it is sent on the redirect back from the provider; Secure under https).
``POST /auth/logout`` revokes it. Logins, refusals and logouts go to the
audit trail.
"""

from __future__ import annotations

import hmac
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlsplit

from authlib.common.security import generate_token
from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from dashboard.access import SESSION_COOKIE, record
from dashboard.errors import LoginRefused, ProviderError
from dashboard.oidc import Identity, OidcClient
from runstore.accounts import AccountError, Principal, account_for_identity, end_session, issue_session
from runstore.audit import LOGIN, LOGIN_FAILED, LOGOUT

__all__ = ["router", "PendingLogins", "Pending", "PENDING_COOKIE", "PENDING_TTL_S", "safe_next"]

router = APIRouter(include_in_schema=False)
PENDING_COOKIE = "quorum_login"
PENDING_TTL_S = 600.0
MAX_PENDING = 10_000
_STATE = re.compile(r"[A-Za-z0-9]{43}")   # generate_token(43): 256 bits
_CODE = re.compile(r"[\x21-\x7e]{1,4096}")  # RFC 6749 A.11: VSCHAR, no spaces
MAX_NEXT = 2000


@dataclass(frozen=True)
class Pending:
    """One login on its way through the provider: what its callback must match."""

    nonce: str
    verifier: str
    redirect_uri: str
    after: str
    created: float


class PendingLogins:
    """The logins started here and not yet back: by ``state``, each taken once, for 10 minutes, at most 10,000."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._by_state: OrderedDict[str, Pending] = OrderedDict()
        self._clock = clock

    def start(self, redirect_uri: str, after: str) -> tuple[str, Pending]:
        """Return a fresh ``state`` and the login it names (its nonce and PKCE verifier)."""
        self._expire()
        while len(self._by_state) >= MAX_PENDING:  # a flood of abandoned logins drops the oldest first
            self._by_state.popitem(last=False)
        state = generate_token(43)
        pending = Pending(nonce=generate_token(43), verifier=generate_token(64), redirect_uri=redirect_uri,
                          after=after, created=self._clock())
        self._by_state[state] = pending
        return state, pending

    def take(self, state: str) -> Pending | None:
        """Return and forget the login of ``state``; None when there is none (unknown, taken, or expired)."""
        self._expire()
        return self._by_state.pop(state, None)

    def _expire(self) -> None:
        now = self._clock()
        while self._by_state and now - next(iter(self._by_state.values())).created > PENDING_TTL_S:
            self._by_state.popitem(last=False)


def safe_next(value: str | None) -> str:
    """Return ``value`` if it is a path of this dashboard to go back to after the login, else ``/``."""
    if (not isinstance(value, str) or not value.startswith("/") or value.startswith(("//", "/\\"))
            or len(value) > MAX_NEXT or not value.isprintable() or "\\" in value):
        return "/"
    return value


def _page(request: Request, status: int, title: str, detail: str) -> Response:
    templates: Jinja2Templates = request.app.state.templates  # set by dashboard.app.create_app
    return templates.TemplateResponse(request, "error.html", {"title": title, "detail": detail, "nav": ""},
                                      status_code=status)


def _client(request: Request) -> OidcClient | None:
    found = getattr(request.app.state, "oidc", None)
    return found if isinstance(found, OidcClient) else None


def _not_configured(request: Request) -> Response:
    return _page(request, 404, "Not found", "This dashboard has no identity provider to log in with "
                 "(quorum dashboard --oidc-issuer URL --oidc-client-id ID).")


def _cookie(name: str, value: str, secure: bool, max_age: int, path: str = "/") -> str:
    return (f"{name}={value}; Path={path}; Max-Age={max_age}; HttpOnly; SameSite=Lax"
            + ("; Secure" if secure else ""))


@router.get("/auth/login")
async def login(request: Request, after: Annotated[str | None, Query(alias="next")] = None) -> Response:
    """Send the browser to the identity provider to log in (code flow with PKCE, ``state`` and ``nonce``)."""
    client = _client(request)
    if client is None:
        return _not_configured(request)
    base = client.settings.public_url or str(request.base_url).rstrip("/")
    redirect_uri = base + "/auth/callback"
    pending_logins: PendingLogins = request.app.state.pending_logins  # set by dashboard.app.create_app
    state, pending = pending_logins.start(redirect_uri, safe_next(after))
    try:
        url = await client.authorization_url(redirect_uri, state, pending.nonce, pending.verifier)
    except ProviderError as exc:
        pending_logins.take(state)
        return _page(request, 502, "Identity provider unavailable", f"{exc}.")
    response = RedirectResponse(url, status_code=302)
    response.headers.append("set-cookie", _cookie(PENDING_COOKIE, state, redirect_uri.startswith("https:"),
                                                  int(PENDING_TTL_S), path="/auth/"))
    return response


def _failed(request: Request, status: int, reason: str, detail: str, identity: Identity | None = None,
            audit: bool = True) -> Response:
    """Record a refused login (best effort) and answer the page that says why."""
    if audit:
        record(request.app.state.reader.store, LOGIN_FAILED, None, presented="oidc", reason=reason[:120],
               issuer=identity.issuer if identity else "", subject=identity.subject if identity else "")
    return _page(request, status, "Login refused" if status == 403 else f"Error {status}", detail)


@router.get("/auth/callback")
async def callback(request: Request) -> Response:
    """Take the provider's answer: check ``state`` against this browser, the code and the ID token; open a session."""
    client = _client(request)
    if client is None:
        return _not_configured(request)
    params = request.query_params
    state, cookie = params.get("state", ""), request.cookies.get(PENDING_COOKIE, "")
    bound = bool(_STATE.fullmatch(state)) and hmac.compare_digest(state.encode(), cookie.encode("utf-8", "replace"))
    pending = request.app.state.pending_logins.take(state) if bound else None
    if pending is None:
        # recorded only for a browser that started a login here: a bare hit on the address is no login attempt
        return _failed(request, 400, "unknown state", "This login was started in another browser, was already "
                       "used, or is over 10 minutes old: log in again.", audit=bool(cookie))
    if params.get("iss") not in (None, client.settings.issuer):  # RFC 9207: an answer from another provider
        return _failed(request, 400, "wrong issuer", "The answer names another identity provider than this "
                       "dashboard's: log in again.")
    if "error" in params:
        error = params.get("error", "")[:60]
        return _failed(request, 403, f"provider error: {error}", f"The identity provider did not log you in "
                       f"({error}: {params.get('error_description', '')[:200]}).")
    code = params.get("code", "")
    if not _CODE.fullmatch(code):
        return _failed(request, 400, "malformed code", "The identity provider's answer holds no usable code: "
                       "log in again.")
    try:
        identity = await client.login(code, pending.redirect_uri, pending.verifier, pending.nonce)
    except LoginRefused as exc:
        return _failed(request, 403, exc.reason, f"Your identity provider's answer was refused ({exc.reason}): {exc}.")
    except ProviderError as exc:
        return _failed(request, 502, "provider unavailable", f"{exc}.")
    return _open_session(request, client, identity, pending)


def _open_session(request: Request, client: OidcClient, identity: Identity, pending: Pending) -> Response:
    store = request.app.state.reader.store
    account = account_for_identity(store, identity.issuer, identity.subject)
    if account is None:
        return _failed(request, 403, "no account", f"You logged in at {identity.issuer} as {identity.subject!r}, "
                       "but no Quorum account is linked to that identity: ask an admin to run `quorum accounts add "
                       f"NAME --org ORG --role ROLE --oidc-issuer {identity.issuer} --oidc-subject "
                       f"{identity.subject}`.", identity)
    if account.revoked_at is not None:
        return _failed(request, 403, "account revoked", f"The Quorum account {account.name!r} linked to your "
                       "identity is revoked.", identity)
    try:
        digest = issue_session(store, account.name, client.settings.session_hours)
    except AccountError as exc:  # revoked between the two reads
        return _failed(request, 403, "account revoked", f"{exc}.", identity)
    principal = Principal(name=account.name, org=account.org, role=account.role)
    record(store, LOGIN, principal, via="oidc", issuer=identity.issuer, subject=identity.subject)
    response = RedirectResponse(pending.after, status_code=303)
    secure = pending.redirect_uri.startswith("https:")
    response.headers.append("set-cookie", _cookie(SESSION_COOKIE, digest, secure,
                                                  int(client.settings.session_hours * 3600)))
    response.headers.append("set-cookie", _cookie(PENDING_COOKIE, "", secure, 0, path="/auth/"))
    return response


def _same_origin(request: Request) -> bool:
    """Whether a POST comes from a page of this dashboard, as the browser says.

    ``Sec-Fetch-Site`` where the browser sends it; else ``Origin`` (which a
    page under ``Referrer-Policy: no-referrer``, as this dashboard's, sends as
    ``null``). A request with neither is no browser's form: it holds the cookie itself.
    """
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return True
    client = _client(request)
    own = {f"{request.url.scheme}://{request.headers.get('host', '')}"}
    if client is not None and client.settings.public_url:
        parts = urlsplit(client.settings.public_url)
        own.add(f"{parts.scheme}://{parts.netloc}")
    return origin in own


@router.post("/auth/logout")
async def logout(request: Request) -> Response:
    """End this browser's session (revoking a provider login's; an API token's stays valid) and forget the cookie."""
    if not _same_origin(request):
        return _page(request, 403, "Error 403", "Forbidden: a page of another site may not log you out.")
    store = request.app.state.reader.store
    ended = end_session(store, request.cookies.get(SESSION_COOKIE, ""))
    if ended is not None:
        found = request.scope.get("state", {}).get("principal")  # the session's own account, as AccessGuard found it
        who = found if isinstance(found, Principal) and found.name == ended else Principal(ended, "", "")
        record(store, LOGOUT, who)
    response = RedirectResponse("/", status_code=303)
    response.headers.append("set-cookie", _cookie(SESSION_COOKIE, "", request.url.scheme == "https", 0))
    return response

