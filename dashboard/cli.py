"""``quorum dashboard``: serve the dashboard over a run store."""

from __future__ import annotations

import os
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.text import Text

from core.errors import QuorumError
from dashboard.auth import OIDC_SECRET_ENV, TOKEN_ENV, check_bind, check_tls, check_token, is_loopback
from dashboard.errors import InsecureBind, OidcConfigError
from runstore.store_url import default_db_url

__all__ = ["app"]

console = Console(stderr=True, markup=False, highlight=False)  # every text printed as it is


def app(
    db: Annotated[str, typer.Option("--db", help="Run store: an SQLAlchemy URL.", envvar="QUORUM_DB")]
    = default_db_url(),
    host: Annotated[str, typer.Option(help="Address to bind; anything but loopback needs --token.")]
    = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8765,
    token: Annotated[str | None, typer.Option(help="Access token required by every page and API call.",
                                                 envvar=TOKEN_ENV, show_envvar=True)] = None,
    tls_cert: Annotated[str | None, typer.Option(help="TLS certificate (PEM) to serve HTTPS with, e.g. the "
                                                      "federation's server.pem from `quorum`'s PKI folder.")] = None,
    tls_key: Annotated[str | None, typer.Option(help="Its private key (PEM), e.g. server.key.")] = None,
    plain_http: Annotated[bool, typer.Option(help="Serve plain HTTP beyond loopback (only behind a proxy that "
                                                  "terminates TLS): the token would otherwise travel in clear.")]
    = False,
    oidc_issuer: Annotated[str | None, typer.Option(
        help="Let accounts log in at this OpenID provider (its issuer URL, as its discovery document names it; "
             "https beyond loopback). Accounts are linked to their identity there with `quorum accounts add NAME "
             "--oidc-issuer URL --oidc-subject SUB`. The client secret, if the provider gave one, is read from "
             f"{OIDC_SECRET_ENV}, never from a flag.")] = None,
    oidc_client_id: Annotated[str | None, typer.Option(
        help="The dashboard's client id at that provider; register the redirect URL PUBLIC-URL/auth/callback "
             "there.")] = None,
    accounts: Annotated[bool, typer.Option(
        "--accounts", help="Serve the run store's accounts only (quorum accounts): every request needs an "
                           "account's token or login, never the open loopback mode; with it the dashboard may "
                           "listen beyond loopback without --token.")] = False,
    public_url: Annotated[str | None, typer.Option(
        help="The address browsers reach the dashboard at (e.g. https://quorum.example.org behind a proxy): the "
             "provider sends them back to PUBLIC-URL/auth/callback. Default: the address of the request.")] = None,
) -> None:
    """Serve the live web dashboard (read-only) over the run store."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from dashboard.oidc import OidcClient, oidc_settings

    oidc = None
    try:
        if oidc_issuer is not None or oidc_client_id is not None or public_url is not None:
            if oidc_issuer is None or oidc_client_id is None:
                raise OidcConfigError("give --oidc-issuer and --oidc-client-id together (and --public-url only "
                                      "with them)")
            oidc = OidcClient(oidc_settings(oidc_issuer, oidc_client_id, os.environ.get(OIDC_SECRET_ENV),
                                            public_url))
        check_token(token)
        check_bind(host, token, accounts)
        check_tls(tls_cert, tls_key)
        if not is_loopback(host) and not tls_cert and not plain_http:
            raise InsecureBind(f"--host {host!r} serves beyond loopback: give --tls-cert and --tls-key so the "
                               "token and the session cookie travel over HTTPS (or --plain-http behind a TLS proxy)")
        shown_db = make_url(db).render_as_string(hide_password=True)
    except (InsecureBind, OidcConfigError) as exc:
        _fail(str(exc))
    except ArgumentError:
        _fail(f"--db {db!r} is not an SQLAlchemy URL (e.g. sqlite:///runs/quorum.db)")
    import uvicorn

    from dashboard.app import create_app
    from runstore.accounts import has_live_accounts

    try:  # the store opened before the address is announced: a bad one is one line (runstore/opening.py)
        dashboard = create_app(db, token=token or None, oidc=oidc, accounts_only=accounts)
    except QuorumError as exc:
        _fail(str(exc))
    if accounts and not has_live_accounts(dashboard.state.reader.store):
        _fail(f"--accounts: the store {shown_db} has no account: add one first (quorum accounts add NAME --org ORG "
              "--role admin --db ...)")
    shown = f"[{host}]" if ":" in host else host
    scheme = "https" if tls_cert else "http"
    console.print(Text.assemble("Quorum dashboard on ", (f"{scheme}://{shown}:{port}/", "bold"),
                                f" (store {shown_db})" + (", token required" if token else "")
                                + (", accounts only" if accounts else "")
                                + (f", login at {oidc_issuer}" if oidc else "")))
    uvicorn.run(dashboard, host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=2, ssl_certfile=tls_cert, ssl_keyfile=tls_key)


def _fail(message: str) -> NoReturn:
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(2)
