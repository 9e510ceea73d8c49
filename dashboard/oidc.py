"""Logging in with an organisation's own identity provider: OpenID Connect's relying party, on Authlib.

The authorization code flow with PKCE (RFC 7636, ``S256``), ``state`` and
``nonce`` (OpenID Connect Core 1.0, 3.1.2.1 and 15.5.2). The provider's
endpoints and keys come from its discovery document, whose ``issuer`` must be
the configured one, character for character (Discovery 1.0, 4.3); an issuer
or endpoint in clear HTTP is accepted on loopback only. Authlib builds the
authorization request and exchanges the code at the token endpoint, the
client authenticated with ``client_secret_basic`` (``client_secret_post``
where the provider takes only that; PKCE alone for a public client, when no
secret is set).

The ID token (Core 3.1.3.7) is checked in two steps: its signature with
joserfc (Authlib's JOSE library) against the provider's JWKS, by one of the
asymmetric algorithms the provider advertises (never ``none``, never an HMAC
keyed by something an attacker might know); then its claims with Authlib's
``CodeIDToken``: ``iss`` is the issuer, ``aud`` holds the client id (``azp``
is the client id when there are several audiences), ``exp`` has not passed
and ``iat`` is not in the future (a minute's leeway for clocks), ``nonce`` is
the one this login sent, and ``at_hash`` matches the access token. The
result is the identity the account is matched by: issuer and subject.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import httpx2
from authlib.integrations.base_client import OAuthError
from authlib.integrations.httpx_client import AsyncOAuth2Client
from authlib.oidc.core import CodeIDToken
from joserfc import jwt
from joserfc.errors import InvalidKeyIdError, JoseError, MissingClaimError
from joserfc.jwk import KeySet, KeySetSerialization
from joserfc.jws import JWSRegistry

from dashboard.auth import OIDC_SECRET_ENV as SECRET_ENV
from dashboard.auth import is_loopback
from dashboard.errors import LoginRefused, OidcConfigError, ProviderError

__all__ = ["OidcSettings", "Identity", "ProviderMetadata", "OidcClient", "oidc_settings", "verify_id_token",
           "SECRET_ENV", "SIGNING_ALGORITHMS", "LEEWAY_S"]

#: The only scope asked for: the subject is all an account is matched by.
SCOPE = "openid"
#: Signature algorithms an ID token may use: asymmetric ones (the provider's key signs, anyone can check).
SIGNING_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
LEEWAY_S = 60
HTTP_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 1 << 20        # a discovery document, a JWKS or a token answer: far less in practice
JWKS_REFRESH_S = 60.0           # an unknown key id refetches the provider's keys at most this often
MAX_TOKEN_CHARS = 16384
_REASONS = {"iss": "wrong issuer", "aud": "wrong audience", "azp": "wrong audience", "exp": "expired",
            "nonce": "wrong nonce", "iat": "issued in the future", "nbf": "not yet valid",
            "at_hash": "wrong access token hash", "sub": "bad subject"}


@dataclass(frozen=True)
class OidcSettings:
    """How the dashboard logs in at one OpenID provider (``quorum dashboard --oidc-*``)."""

    issuer: str
    client_id: str
    client_secret: str | None = field(default=None, repr=False)
    public_url: str | None = None  # where browsers reach the dashboard; else the request's own address
    session_hours: float = 8.0


@dataclass(frozen=True)
class Identity:
    """Who the provider vouched for: the account is matched by ``(issuer, subject)``."""

    issuer: str
    subject: str


@dataclass(frozen=True)
class ProviderMetadata:
    """What the dashboard uses of a provider's discovery document."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    algorithms: tuple[str, ...]
    token_auth_methods: tuple[str, ...]


def _plain_http_ok(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "https" or (parts.scheme == "http" and is_loopback(parts.hostname or ""))


def _check_url(option: str, url: str, what: str) -> str:
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise OidcConfigError(f"{option} {url!r}: {what}, https://... without a query or fragment")
    if not _plain_http_ok(url):
        raise OidcConfigError(f"{option} {url!r}: https is required beyond loopback (the login's codes and "
                              "cookies would travel in clear)")
    return url


def oidc_settings(issuer: str, client_id: str | None, client_secret: str | None = None,
                  public_url: str | None = None, session_hours: float = 8.0) -> OidcSettings:
    """Return checked :class:`OidcSettings`, or raise :class:`OidcConfigError` naming the bad setting."""
    _check_url("--oidc-issuer", issuer, "the provider's issuer URL")
    if not client_id or not client_id.isprintable() or client_id != client_id.strip() or len(client_id) > 255:
        raise OidcConfigError(f"--oidc-client-id {client_id!r}: the client id registered at the provider "
                              "(1-255 printable characters)")
    if client_secret is not None and (not client_secret.strip() or client_secret != client_secret.strip()):
        raise OidcConfigError(f"{SECRET_ENV} is blank or has spaces around it: give the client secret as the "
                              "provider shows it, or unset the variable for a public client (PKCE only)")
    if public_url is not None:
        _check_url("--public-url", public_url, "the address browsers reach the dashboard at")
    if not isinstance(session_hours, int | float) or not 0 < session_hours <= 720:
        raise OidcConfigError(f"--session-hours {session_hours!r}: more than 0, at most 720")
    return OidcSettings(issuer=issuer, client_id=client_id, client_secret=client_secret or None,
                        public_url=public_url.rstrip("/") if public_url else None, session_hours=float(session_hours))


def verify_id_token(raw: str, keys: KeySet, algorithms: tuple[str, ...], issuer: str, client_id: str, nonce: str,
                    access_token: str | None = None, now: float | None = None) -> Identity:
    """Check an ID token's signature and claims (the module docstring); return its identity.

    Raises
    ------
    LoginRefused
        Any check failed; ``reason`` names which (``bad signature``,
        ``wrong issuer``, ``wrong audience``, ``expired``, ``wrong nonce``, ...).
    InvalidKeyIdError
        The token names a key the set does not hold (the caller refetches the keys once).
    """
    if not isinstance(raw, str) or len(raw) > MAX_TOKEN_CHARS:
        raise LoginRefused("malformed ID token", "the identity provider's ID token is missing or too long")
    try:
        token = jwt.decode(raw, keys, registry=JWSRegistry(algorithms=list(algorithms)))
    except InvalidKeyIdError:
        raise
    except (JoseError, ValueError, TypeError, KeyError) as exc:
        raise LoginRefused("bad signature", "the ID token's signature does not verify against the identity "
                           f"provider's published keys ({type(exc).__name__})") from None
    claims = CodeIDToken(token.claims, token.header, {"iss": {"essential": True, "value": issuer},
                                                     "aud": {"essential": True, "value": client_id},
                                                     "sub": {"essential": True}},
                         {"nonce": nonce, "client_id": client_id, "access_token": access_token})
    stamp = int(time.time() if now is None else now)
    try:
        claims.validate(now=stamp, leeway=LEEWAY_S)
    except JoseError as exc:
        reason = _claim_reason(exc)
        raise LoginRefused(reason, f"the identity provider's ID token was refused: {reason}") from None
    subject = token.claims["sub"]
    if not isinstance(subject, str) or not 0 < len(subject) <= 255 or not subject.isprintable():
        raise LoginRefused("bad subject", "the ID token's subject is not 1-255 printable characters")
    return Identity(issuer=issuer, subject=subject)


def _claim_reason(exc: JoseError) -> str:
    """Return a short phrase for a failed claim check (``exp`` -> ``expired``), for the page and the audit trail."""
    claim = str(getattr(exc, "claim", ""))[:40]
    if isinstance(exc, MissingClaimError):
        return f"missing claim {claim}"
    return _REASONS.get(claim, f"invalid claim {claim}")


class OidcClient:
    """One provider, as the dashboard talks to it: discovery, the authorization request, the code, the keys.

    ``transport`` is an ``httpx2`` transport for tests (an in-process provider);
    ``clock`` returns the time ID tokens are checked against.
    """

    def __init__(self, settings: OidcSettings, transport: httpx2.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self._transport = transport
        self._clock = clock
        self._metadata: ProviderMetadata | None = None
        self._keys: tuple[float, KeySet] | None = None

    def _http(self) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(transport=self._transport, timeout=HTTP_TIMEOUT_S, follow_redirects=False)

    async def _get_json(self, url: str, what: str) -> dict[str, Any]:
        try:
            async with self._http() as http, http.stream("GET", url, headers={"accept": "application/json"}) as r:
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        raise ProviderError(f"the identity provider's {what} at {url} is over 1 MiB")
                status = r.status_code
        except httpx2.HTTPError as exc:
            raise ProviderError(f"the identity provider's {what} at {url} cannot be read: {exc}") from None
        if status != 200:
            raise ProviderError(f"the identity provider's {what} at {url} answered HTTP {status}")
        try:
            found = json.loads(body)
        except ValueError:
            found = None
        if not isinstance(found, dict):
            raise ProviderError(f"the identity provider's {what} at {url} is not a JSON object")
        return found

    async def metadata(self) -> ProviderMetadata:
        """Return the provider's metadata, read from its discovery document once (and again after a failure)."""
        if self._metadata is None:
            url = self.settings.issuer.rstrip("/") + "/.well-known/openid-configuration"
            self._metadata = _read_metadata(await self._get_json(url, "discovery document"), self.settings.issuer)
        return self._metadata

    async def _key_set(self, refresh: bool = False) -> KeySet:
        now = time.monotonic()
        if self._keys is None or (refresh and now - self._keys[0] >= JWKS_REFRESH_S):
            meta = await self.metadata()
            try:
                found = await self._get_json(meta.jwks_uri, "key set (JWKS)")
                keys = KeySet.import_key_set(cast("KeySetSerialization", found))
            except (JoseError, ValueError, TypeError, KeyError) as exc:
                raise ProviderError(f"the identity provider's key set at {meta.jwks_uri} cannot be used: "
                                    f"{type(exc).__name__}") from None
            self._keys = (now, keys)
        return self._keys[1]

    def _oauth(self, redirect_uri: str, meta: ProviderMetadata) -> AsyncOAuth2Client:
        secret = self.settings.client_secret
        method = "none" if secret is None else (
            "client_secret_post" if "client_secret_basic" not in meta.token_auth_methods
            and "client_secret_post" in meta.token_auth_methods else "client_secret_basic")
        return AsyncOAuth2Client(client_id=self.settings.client_id, client_secret=secret, scope=SCOPE,
                                 redirect_uri=redirect_uri, token_endpoint_auth_method=method,
                                 code_challenge_method="S256", transport=self._transport, timeout=HTTP_TIMEOUT_S)

    async def authorization_url(self, redirect_uri: str, state: str, nonce: str, code_verifier: str) -> str:
        """Return the provider's address to send the browser to (code flow, PKCE S256, ``state``, ``nonce``)."""
        meta = await self.metadata()
        async with self._oauth(redirect_uri, meta) as client:
            url, _ = client.create_authorization_url(meta.authorization_endpoint, state=state,
                                                     code_verifier=code_verifier, nonce=nonce)
        return str(url)

    async def login(self, code: str, redirect_uri: str, code_verifier: str, nonce: str) -> Identity:
        """Exchange the code for tokens and return the verified identity of the ID token.

        Raises
        ------
        LoginRefused
            The provider refused the code, or the ID token failed a check.
        ProviderError
            The provider could not be reached or answered nonsense.
        """
        meta = await self.metadata()
        tokens = await self._exchange(meta, code, redirect_uri, code_verifier)
        raw, access = tokens.get("id_token"), tokens.get("access_token")
        if not isinstance(raw, str):
            raise LoginRefused("no ID token", "the identity provider's answer holds no ID token")
        for refresh in (False, True):  # an unknown key id: the provider may have rotated its keys since they were read
            try:
                return verify_id_token(raw, await self._key_set(refresh), meta.algorithms, meta.issuer,
                                       self.settings.client_id, nonce, access if isinstance(access, str) else None,
                                       self._clock())
            except InvalidKeyIdError:
                continue
        raise LoginRefused("unknown key", "the ID token is signed by a key the identity provider does not publish")

    async def _exchange(self, meta: ProviderMetadata, code: str, redirect_uri: str, verifier: str) -> dict[str, Any]:
        """Exchange the code at the token endpoint (the client's credentials, the PKCE verifier); return the answer."""
        try:
            async with self._oauth(redirect_uri, meta) as client:
                tokens = await client.fetch_token(meta.token_endpoint, grant_type="authorization_code", code=code,
                                                  redirect_uri=redirect_uri, code_verifier=verifier)
        except OAuthError as exc:
            raise LoginRefused("code refused", f"the identity provider refused the login's code "
                               f"({str(getattr(exc, 'error', 'error'))[:60]})") from None
        except httpx2.HTTPStatusError as exc:
            raise ProviderError(f"the identity provider's token endpoint answered HTTP "
                                f"{exc.response.status_code}") from None
        except (httpx2.HTTPError, ValueError) as exc:
            raise ProviderError(f"the identity provider's token endpoint cannot be used: {exc}") from None
        return dict(tokens)


def _read_metadata(doc: dict[str, Any], issuer: str) -> ProviderMetadata:
    """Check a discovery document against the configured issuer; keep what the login uses."""
    if doc.get("issuer") != issuer:
        raise ProviderError(f"the discovery document names its issuer {str(doc.get('issuer'))[:200]!r}, not "
                            f"{issuer!r}: give --oidc-issuer exactly as the provider names itself")
    urls = {}
    for key in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
        value = doc.get(key)
        if not isinstance(value, str) or not _plain_http_ok(value) or not urlsplit(value).hostname:
            raise ProviderError(f"the discovery document's {key} {str(value)[:200]!r} is not an https URL")
        urls[key] = value
    advertised = doc.get("id_token_signing_alg_values_supported") or ["RS256"]
    algorithms = tuple(a for a in SIGNING_ALGORITHMS if isinstance(advertised, list) and a in advertised)
    if not algorithms:
        raise ProviderError(f"the provider signs ID tokens with {advertised!r}: none of "
                            f"{', '.join(SIGNING_ALGORITHMS)}")
    methods = doc.get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
    return ProviderMetadata(issuer=issuer, algorithms=algorithms,
                            token_auth_methods=tuple(m for m in methods if isinstance(m, str)), **urls)
