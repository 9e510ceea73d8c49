"""Where the dashboard may listen, and with which token: the checks before it serves, and the Host guard.

Who a request acts for, and what it may see, is ``dashboard.access``: a
request carries an account's token or the single shared token as
``Authorization: Bearer TOKEN``, as a cookie set by an earlier request, or once
as ``?token=TOKEN`` (which sets the cookie; a page request is then redirected
to the same address without it, so the token does not linger in the address
bar or the history).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from dashboard.errors import InsecureBind

__all__ = ["is_loopback", "host_is_loopback", "check_bind", "check_tls", "check_token", "LoopbackHostGuard",
           "COOKIE", "TOKEN_ENV", "OIDC_SECRET_ENV"]

COOKIE = "quorum_dashboard"
TOKEN_ENV = "QUORUM_DASHBOARD_TOKEN"
#: The OpenID client secret of ``--oidc-client-id`` (an environment variable, never a flag: flags show in ``ps``).
OIDC_SECRET_ENV = "QUORUM_OIDC_CLIENT_SECRET"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def is_loopback(host: str) -> bool:
    """Return True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


def host_is_loopback(header: str) -> bool:
    """Return True for a ``Host`` header that names this machine: localhost, 127.0.0.0/8 or [::1], any port."""
    value = header.strip()
    if value.startswith("["):
        name, close, port = value[1:].partition("]")
        if not close or (port and not (port.startswith(":") and port[1:].isdigit())):
            return False
    else:
        name, _, port = value.partition(":")
        if port and not port.isdigit():
            return False
    return bool(name) and is_loopback(name)


def check_tls(cert: str | None, key: str | None) -> None:
    """Both TLS files or neither, and a pair that a TLS server can load.

    Raises
    ------
    InsecureBind
        Only one of ``--tls-cert`` and ``--tls-key`` was given, or they cannot
        be read, are not PEM, or the key is not the certificate's.
    """
    if bool(cert) != bool(key):
        raise InsecureBind("give both --tls-cert and --tls-key (e.g. the server.pem and server.key that "
                           "`quorum` made for the federation), or neither")
    if cert and key:
        import ssl

        for option, path in (("--tls-cert", cert), ("--tls-key", key)):
            if not Path(path).is_file():
                raise InsecureBind(f"{option} {path}: no such file")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise InsecureBind(f"--tls-cert {cert} and --tls-key {key} cannot serve TLS ({exc}): give a PEM "
                               "certificate and the PEM private key that belongs to it") from None


def check_token(token: str | None) -> None:
    """Refuse a token that is blank or has blanks around it (no client would send them).

    Raises
    ------
    InsecureBind
        The token is empty or blank, or has blanks around it.
    """
    if token is None:
        return
    if not token.strip():
        raise InsecureBind(f"--token / {TOKEN_ENV} is blank: give a real token (e.g. `openssl rand -hex 16`), "
                           "or none on loopback")
    if token != token.strip():
        raise InsecureBind(f"--token / {TOKEN_ENV} has spaces around it: a browser or curl would not send "
                           "them; give it without")


def check_bind(host: str, token: str | None, accounts: bool = False) -> None:
    """Refuse to serve beyond loopback unless every request must carry credentials.

    That is a shared token, or ``accounts``: only the run store's accounts (``quorum dashboard --accounts``).

    Raises
    ------
    InsecureBind
        ``host`` is not a loopback address, ``token`` is empty and ``accounts`` is off.
    """
    if not is_loopback(host) and not token and not accounts:
        raise InsecureBind(
            f"--host {host!r} makes the dashboard reachable from other machines; give an access token "
            f"with --token or the {TOKEN_ENV} environment variable, or serve accounts only with --accounts "
            "(quorum accounts add), or bind to 127.0.0.1")


class LoopbackHostGuard:
    """ASGI middleware for a dashboard without a token: only loopback ``Host`` headers.

    A page on another site can make the browser resolve its own name to
    127.0.0.1 (DNS rebinding) and then read a token-less dashboard as if it
    were same-origin; such requests carry the attacker's host name in
    ``Host``, so anything but localhost, 127.0.0.0/8 or [::1] is answered 400.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on if its ``Host`` is loopback, else answer 400 (close a websocket with 1008)."""
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")
        if host_is_loopback(host):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            body = b"Host not allowed: without a token the dashboard answers only localhost, 127.0.0.1 or [::1]\n"
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
