"""The dashboard's FastAPI application: ``create_app(db_url, token, oidc)``."""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from sqlalchemy.engine import make_url
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Mount

from dashboard import api, login, pages, submit
from dashboard.access import AccessGuard, iter_routes
from dashboard.auth import ASGIApp, LoopbackHostGuard, Message, Receive, Scope, Send
from dashboard.metrics import make_registry
from dashboard.oidc import OidcClient
from dashboard.queries import Reader
from dashboard.views import fmt_bytes, fmt_duration, fmt_num, fmt_pct, fmt_time

__all__ = ["create_app", "plotly_dir", "PLOTLY_URL"]

HERE = Path(__file__).parent
PLOTLY_URL = "/static/vendor/plotly/plotly.min.js"
API_PREFIXES = ("/api/", "/metrics", "/openapi.json")
# Scripts only from this server (data is passed as JSON, never as inline script); the
# charting library injects its own <style> elements, hence 'unsafe-inline' for styles.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data: blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
       "frame-ancestors 'none'; form-action 'self'")
DESCRIPTION = ("Read-only view of a Quorum run store: runs, rounds, client outcomes. "
               "Live updates are Server-Sent Events; `/metrics` serves Prometheus text.")


def create_app(db_url: str, token: str | None = None, oidc: OidcClient | None = None,
               accounts_only: bool = False) -> FastAPI:
    """Build the dashboard over the run store at ``db_url``.

    Parameters
    ----------
    db_url : str
        SQLAlchemy URL of the run store the aggregator writes (e.g. ``sqlite:///runs/quorum.db``).
    token : str, optional
        The single shared token: when given, every page and API call must carry it (bearer header, cookie,
        or ``?token=``) or an account's token (``dashboard.access``); it acts as ``admin``.
    accounts_only : bool
        Every request needs an account's token or login (or ``token``): never the open loopback mode, even
        once no account is left (``quorum dashboard --accounts``, which may then listen beyond loopback).
    oidc : OidcClient, optional
        The organisation's identity provider: accounts linked to one of its identities log in at
        ``/auth/login`` (``dashboard.login``). Without it those routes answer 404.
    """
    app = FastAPI(title="Quorum dashboard", description=DESCRIPTION, version="1", lifespan=_lifespan,
                  docs_url=None, redoc_url=None)  # Swagger UI and ReDoc load from a CDN: offline here
    app.state.reader = Reader(db_url)
    app.state.registry = make_registry(app.state.reader)
    app.state.templates = _templates(db_url, token_required=bool(token))
    app.state.templates.env.globals["oidc_login"] = oidc is not None
    app.state.oidc = oidc
    app.state.pending_logins = login.PendingLogins()
    app.include_router(api.router)
    app.include_router(api.metrics_router)
    app.include_router(pages.router)
    app.include_router(login.router)
    app.include_router(submit.router)
    vendor = plotly_dir()
    if vendor is not None:
        app.mount("/static/vendor/plotly", StaticFiles(directory=vendor), name="plotly")
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(GZipMiddleware, minimum_size=1024, compresslevel=6)
    app.add_middleware(AccessGuard, store=app.state.reader.store,
                       routes=[r for r in iter_routes(app.routes) if not isinstance(r, Mount)],
                       token=token, unauthorized=_unauthorized(app.state.templates),
                       forbidden=_forbidden(app.state.templates), open_local=not accounts_only)
    if not token and not accounts_only:  # open to this machine: loopback only, kept true against DNS rebinding
        app.add_middleware(LoopbackHostGuard)
    app.add_middleware(SecurityHeaders)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Close the store's pooled connections (a PostgreSQL server's) when the dashboard shuts down."""
    yield
    app.state.reader.store.close()


def plotly_dir() -> Path | None:
    """Return the installed ``plotly`` package's folder holding ``plotly.min.js`` (without importing plotly).

    None when plotly is not installed or its folder lacks ``plotly.min.js``.
    """
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "package_data"
    return folder if (folder / "plotly.min.js").is_file() else None


def _templates(db_url: str, token_required: bool) -> Jinja2Templates:
    templates = Jinja2Templates(directory=HERE / "templates")
    env = templates.env
    env.filters.update(time=fmt_time, duration=fmt_duration, bytes=fmt_bytes, pct=fmt_pct, num=fmt_num)
    env.globals.update(plotly_url=PLOTLY_URL if plotly_dir() is not None else None,
                       token_required=token_required,
                       store_url=make_url(db_url).render_as_string(hide_password=True))
    return templates


def _is_api(path: str) -> bool:
    return path.startswith(API_PREFIXES)


async def _http_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, StarletteHTTPException):  # registered for HTTPException only
        raise exc
    if _is_api(request.url.path):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
    title = "Not found" if exc.status_code == 404 else f"Error {exc.status_code}"
    templates: Jinja2Templates = request.app.state.templates  # set by create_app
    return templates.TemplateResponse(
        request, "error.html", {"title": title, "detail": exc.detail, "nav": ""}, status_code=exc.status_code)


def _unauthorized(templates: Jinja2Templates) -> Any:
    def respond(scope: Scope) -> ASGIApp:
        if _is_api(scope["path"]):
            return JSONResponse({"detail": "a token is required: Authorization: Bearer TOKEN"},
                                status_code=401, headers={"www-authenticate": "Bearer"})
        return templates.TemplateResponse(Request(scope), "login.html", {"nav": ""}, status_code=401,
                                          headers={"www-authenticate": "Bearer"})
    return respond


def _forbidden(templates: Jinja2Templates) -> Any:
    def respond(scope: Scope, why: str) -> ASGIApp:
        if _is_api(scope["path"]):
            return JSONResponse({"detail": f"forbidden: {why}"}, status_code=403)
        return templates.TemplateResponse(Request(scope), "error.html",
                                          {"title": "Error 403", "detail": f"Forbidden: {why}.", "nav": ""},
                                          status_code=403)
    return respond


class SecurityHeaders:
    """Adds CSP and related headers; pages and API answers are never cached."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"content-security-policy", CSP.encode()),
                           (b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                           (b"referrer-policy", b"no-referrer")]
                if not static:
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)
