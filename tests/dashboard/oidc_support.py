"""An OpenID provider served in-process (an ``httpx2`` transport): no socket, no process, fast tier.

It does what a provider does for the code flow, strictly: a discovery
document, its JWKS, an authorization step (what the browser's visit would
do: check the request, remember its PKCE challenge and nonce, answer the
callback address with a one-time code) and a token endpoint that checks the
client's secret, the code, the redirect URL and the PKCE verifier before it
mints an RS256 ID token. ``tamper`` rewrites the next ID token's claims and
``sign_with`` / ``header`` sign it otherwise: the tests of what the dashboard
must refuse.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx2
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey

ISSUER = "https://idp.example.org"
CLIENT_ID = "quorum-dashboard"
CLIENT_SECRET = "client-secret-for-tests-0123456789"
REDIRECT = "http://127.0.0.1/auth/callback"


@dataclass
class Grant:
    client_id: str
    redirect_uri: str
    challenge: str
    nonce: str
    subject: str


@dataclass
class FakeProvider:
    issuer: str = ISSUER
    key: RSAKey = field(default_factory=lambda: RSAKey.generate_key(2048, parameters={"kid": "k1"}, private=True))
    grants: dict[str, Grant] = field(default_factory=dict)
    tamper: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    sign_with: RSAKey | None = None
    header: dict[str, Any] | None = None
    token_status: int = 200
    doc_issuer: str | None = None
    requests: list[str] = field(default_factory=list)

    def transport(self) -> httpx2.MockTransport:
        return httpx2.MockTransport(self.handle)

    # ------------------------------------------------------------------ the browser's visit
    def authorize(self, location: str, subject: str = "ana-sub") -> str:
        """Check an authorization request as the provider would, and return the callback URL it redirects to."""
        parts = urlsplit(location)
        assert f"{parts.scheme}://{parts.netloc}{parts.path}" == f"{self.issuer}/authorize"
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        assert query["response_type"] == "code" and query["client_id"] == CLIENT_ID
        assert "openid" in query["scope"].split() and query["code_challenge_method"] == "S256"
        assert query["state"] and query["nonce"] and len(query["code_challenge"]) == 43
        code = secrets.token_urlsafe(24)
        self.grants[code] = Grant(query["client_id"], query["redirect_uri"], query["code_challenge"], query["nonce"],
                                  subject)
        return f"{query['redirect_uri']}?{urlencode({'code': code, 'state': query['state'], 'iss': self.issuer})}"

    # ------------------------------------------------------------------ the back channel
    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append(f"{request.method} {request.url.path}")
        if request.url.path == "/.well-known/openid-configuration":
            return httpx2.Response(200, json=self.discovery())
        if request.url.path == "/jwks":
            return httpx2.Response(200, json=KeySet([self.key]).as_dict(private=False))
        if request.url.path == "/token" and request.method == "POST":
            return self.token(request)
        return httpx2.Response(404, json={"error": "not_found"})

    def discovery(self) -> dict[str, Any]:
        return {"issuer": self.doc_issuer or self.issuer, "authorization_endpoint": f"{self.issuer}/authorize",
                "token_endpoint": f"{self.issuer}/token", "jwks_uri": f"{self.issuer}/jwks",
                "response_types_supported": ["code"], "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": ["RS256"], "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": ["client_secret_basic"]}

    def token(self, request: httpx2.Request) -> httpx2.Response:
        if self.token_status != 200:
            return httpx2.Response(self.token_status, text="upstream trouble")
        form = {k: v[0] for k, v in parse_qs(request.content.decode()).items()}
        expected = base64.b64encode(f"{CLIENT_ID}:{CLIENT_SECRET}".encode()).decode()
        if request.headers.get("authorization") != f"Basic {expected}":
            return httpx2.Response(401, json={"error": "invalid_client"})
        grant = self.grants.pop(form.get("code", ""), None)
        verifier = form.get("code_verifier", "")
        challenge = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest()).rstrip(b"=").decode()
        if (grant is None or form.get("grant_type") != "authorization_code"
                or form.get("redirect_uri") != grant.redirect_uri or challenge != grant.challenge):
            return httpx2.Response(400, json={"error": "invalid_grant"})
        access = secrets.token_urlsafe(24)
        return httpx2.Response(200, json={"access_token": access, "token_type": "Bearer", "expires_in": 300,
                                          "id_token": self.id_token(grant)})

    def id_token(self, grant: Grant) -> str:
        now = int(time.time())
        claims: dict[str, Any] = {"iss": self.issuer, "sub": grant.subject, "aud": grant.client_id, "exp": now + 300,
                                  "iat": now, "nonce": grant.nonce, "auth_time": now}
        if self.tamper is not None:
            claims = self.tamper(claims)
        header = self.header or {"alg": "RS256", "kid": "k1"}
        if header.get("alg") == "none":  # joserfc will not sign so: the unsigned form, by hand
            encode = lambda part: base64.urlsafe_b64encode(json.dumps(part).encode()).rstrip(b"=").decode()  # noqa: E731
            return f"{encode(header)}.{encode(claims)}."
        return jwt.encode(header, claims, self.sign_with or self.key,
                          algorithms=[header["alg"]])
