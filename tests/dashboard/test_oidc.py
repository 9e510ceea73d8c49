"""Logging in at the organisation's identity provider (issue #48, item 2), against a provider served in-process.

The provider (``oidc_support.FakeProvider``) answers the dashboard's back
channel through an ``httpx2`` transport, so the whole code flow runs here,
in the fast tier: ``/auth/login`` -> the provider's authorization step ->
``/auth/callback`` (code exchange with PKCE, the ID token verified) -> a
session cookie that ``AccessGuard`` accepts. The ID tokens the dashboard must
refuse are minted by the same provider, tampered: another key, another
issuer, another audience, expired, a wrong nonce. The real provider in
Chromium is ``test_oidc_browser.py``.
"""

from __future__ import annotations

import asyncio
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import pytest
from dashboard_support import ROOT  # noqa: F401 (puts the repo on the path)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from joserfc.jwk import OctKey, RSAKey
from oidc_support import CLIENT_ID, CLIENT_SECRET, ISSUER, FakeProvider
from typer.testing import CliRunner

from dashboard.app import create_app
from dashboard.errors import OidcConfigError
from dashboard.login import safe_next
from dashboard.oidc import OidcClient, oidc_settings
from runstore.accounts import AccountError, account_for_identity, add_account, authenticate_digest, revoke_account
from runstore.audit import LOGIN, LOGIN_FAILED, LOGOUT, rows, verify
from runstore.store import RunStore

with warnings.catch_warnings():  # starlette's import-time deprecations (httpx2, anyio aliases), not ours
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

LOCAL = "http://127.0.0.1"


@dataclass
class Site:
    store: RunStore
    provider: FakeProvider
    client: TestClient
    run_id: str


def _app(url: str, provider: FakeProvider, public_url: str | None = None, token: str | None = None) -> Any:
    settings_ = oidc_settings(provider.issuer, CLIENT_ID, CLIENT_SECRET, public_url)
    return create_app(url, token=token, oidc=OidcClient(settings_, transport=provider.transport()))


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    url = f"sqlite:///{tmp_path / 'quorum.db'}"
    store = RunStore(url)
    run_id = store.create_run(name="visible-run", scenario={"name": "visible-run"}, seed=0, strategy="fedavg",
                              rounds=1)
    add_account(store, "ana", "north", "member", issuer=ISSUER, subject="ana-sub")
    add_account(store, "boss", "hq", "admin", issuer=ISSUER, subject="boss-sub")
    provider = FakeProvider()
    with TestClient(_app(url, provider), base_url=LOCAL, follow_redirects=False) as client:
        yield Site(store=store, provider=provider, client=client, run_id=run_id)


def _start(site: Site, after: str = "/") -> str:
    """GET /auth/login; return where the browser is sent (the provider's authorization URL)."""
    response = site.client.get("/auth/login", params={"next": after})
    assert response.status_code == 302, response.text
    return response.headers["location"]


def _log_in(site: Site, subject: str = "ana-sub", after: str = "/") -> Any:
    """The whole flow; return the callback's answer."""
    callback = site.provider.authorize(_start(site, after), subject=subject)
    return site.client.get(callback.removeprefix(LOCAL))


def _actions(store: RunStore, action: str) -> list[Any]:
    return rows(store, limit=1000, action=action)


# --------------------------------------------------------------------------- the flow


def test_a_member_logs_in_and_sees_what_its_role_allows(site: Site) -> None:
    # Execute: the code flow, back to the page the member wanted
    answer = _log_in(site, after=f"/runs/{site.run_id}")

    # Assert: a session cookie holding a digest, never a token; the member's rule applies to it
    assert answer.status_code == 303 and answer.headers["location"] == f"/runs/{site.run_id}"
    cookie = next(c for c in answer.headers.get_list("set-cookie") if c.startswith("quorum_session="))
    value = cookie.split(";")[0].split("=", 1)[1]
    assert re.fullmatch(r"[0-9a-f]{64}", value)
    assert all(flag in cookie for flag in ("HttpOnly", "SameSite=Lax", "Path=/", "Max-Age=28800"))
    assert "Secure" not in cookie  # http on loopback; under https it is (below)
    who = authenticate_digest(site.store, value)
    assert who is not None and (who.name, who.org, who.role) == ("ana", "north", "member")
    assert site.client.get(f"/runs/{site.run_id}").status_code == 200
    assert site.provider.requests == ["GET /.well-known/openid-configuration", "POST /token", "GET /jwks"]
    assert site.client.get("/api/runs").json()[0]["id"] == site.run_id
    assert site.client.get("/metrics").status_code == 403  # admin and service only
    (login,) = _actions(site.store, LOGIN)
    assert (login.actor, login.org, login.detail) == ("ana", "north", {"via": "oidc", "issuer": ISSUER,
                                                                       "subject": "ana-sub"})


def test_the_authorization_request_carries_pkce_state_and_nonce_and_binds_the_browser(site: Site) -> None:
    response = site.client.get("/auth/login")
    query = {k: v[0] for k, v in parse_qs(urlsplit(response.headers["location"]).query).items()}
    assert query["redirect_uri"] == f"{LOCAL}/auth/callback" and query["scope"] == "openid"
    assert query["code_challenge_method"] == "S256" and len(query["code_challenge"]) == 43
    assert len(query["state"]) == 43 and len(query["nonce"]) == 43 and query["state"] != query["nonce"]
    pending = response.headers["set-cookie"]
    assert pending.startswith(f"quorum_login={query['state']};") and "HttpOnly" in pending and "Path=/auth/" in pending
    # no verifier, no nonce in the browser: only the state, which the provider sends back anyway
    assert "code_verifier" not in response.headers["location"]


def test_under_https_the_cookies_are_secure_and_the_redirect_is_the_public_url(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    store = RunStore(url)
    add_account(store, "ana", "north", "member", issuer=ISSUER, subject="ana-sub")
    provider = FakeProvider()
    app = _app(url, provider, public_url="https://quorum.example.org/")
    with TestClient(app, base_url="https://127.0.0.1", follow_redirects=False) as client:
        location = client.get("/auth/login").headers["location"]
        assert parse_qs(urlsplit(location).query)["redirect_uri"] == ["https://quorum.example.org/auth/callback"]
        callback = provider.authorize(location)
        answer = client.get("/auth/callback?" + urlsplit(callback).query)
    assert answer.status_code == 303
    assert all("Secure" in c for c in answer.headers.get_list("set-cookie"))


def test_logout_revokes_the_session_and_is_in_the_audit_trail(site: Site) -> None:
    value = _log_in(site).cookies["quorum_session"]
    assert site.client.get("/api/runs").status_code == 200

    # a page of another site cannot log the user out
    assert site.client.post("/auth/logout", headers={"origin": "https://evil.example.org"}).status_code == 403
    assert site.client.post("/auth/logout", headers={"sec-fetch-site": "cross-site"}).status_code == 403
    assert site.client.get("/api/runs").status_code == 200  # still logged in
    answer = site.client.post("/auth/logout", headers={"origin": "null", "sec-fetch-site": "same-origin"})

    assert answer.status_code == 303 and "quorum_session=;" in answer.headers["set-cookie"]
    assert authenticate_digest(site.store, value) is None  # revoked, not only forgotten by this browser
    replayed = site.client.get("/api/runs", headers={"cookie": f"quorum_session={value}"})
    assert replayed.status_code == 401
    (logout,) = _actions(site.store, LOGOUT)
    assert logout.actor == "ana"
    assert verify(site.store).ok


# --------------------------------------------------------------------------- ID tokens that must be refused

OTHER_KEY = RSAKey.generate_key(2048, parameters={"kid": "k1"}, private=True)
NOW_ISH = 1_700_000_000


def _claims(**changes: Any) -> Any:
    def tamper(claims: dict[str, Any]) -> dict[str, Any]:
        out = {**claims, **changes}
        return {k: v for k, v in out.items() if v is not None}
    return tamper


REFUSED = [
    ("another-key", {"sign_with": OTHER_KEY}, "bad signature"),
    ("another-key-id", {"sign_with": RSAKey.generate_key(2048, parameters={"kid": "k9"}, private=True),
                        "header": {"alg": "RS256", "kid": "k9"}}, "unknown key"),
    ("unsigned", {"header": {"alg": "none"}}, "bad signature"),
    ("hmac-with-the-client-secret", {"sign_with": OctKey.import_key(CLIENT_SECRET), "header": {"alg": "HS256"}},
     "bad signature"),
    ("another-issuer", {"tamper": _claims(iss="https://evil.example.org")}, "wrong issuer"),
    ("another-audience", {"tamper": _claims(aud="someone-else")}, "wrong audience"),
    ("several-audiences-no-azp", {"tamper": _claims(aud=[CLIENT_ID, "someone-else"])}, "missing claim azp"),
    ("expired", {"tamper": _claims(exp=NOW_ISH, iat=NOW_ISH - 300)}, "expired"),
    ("issued-in-the-future", {"tamper": lambda c: {**c, "iat": c["iat"] + 3600, "exp": c["exp"] + 3600}},
     "issued in the future"),
    ("wrong-nonce", {"tamper": _claims(nonce="a-nonce-of-another-login")}, "wrong nonce"),
    ("no-nonce", {"tamper": _claims(nonce=None)}, "missing claim nonce"),
    ("no-subject", {"tamper": _claims(sub=None)}, "missing claim sub"),
]


@pytest.mark.parametrize(("case", "setup", "reason"), REFUSED, ids=[c[0] for c in REFUSED])
def test_an_id_token_that_fails_a_check_is_refused(site: Site, case: str, setup: dict[str, Any], reason: str) -> None:
    # Prepare
    for name, value in setup.items():
        setattr(site.provider, name, value)

    # Execute
    answer = _log_in(site)

    # Assert: 403 naming the check, no session, one failed login in the trail (and no login)
    assert answer.status_code == 403, (case, answer.text[:300])
    assert reason in answer.text
    assert "quorum_session" not in answer.headers.get("set-cookie", "")
    assert site.client.get("/api/runs").status_code == 401
    (failed,) = _actions(site.store, LOGIN_FAILED)
    assert failed.detail["reason"] == reason and failed.detail["presented"] == "oidc"
    assert _actions(site.store, LOGIN) == []


def test_an_unknown_subject_gets_a_clear_403_and_a_failed_login_row(site: Site) -> None:
    answer = _log_in(site, subject="carol-sub")
    assert answer.status_code == 403
    assert "no Quorum account is linked to that identity" in answer.text and "carol-sub" in answer.text
    assert "--oidc-subject carol-sub" in answer.text  # what to tell an admin
    (failed,) = _actions(site.store, LOGIN_FAILED)
    assert failed.detail == {"presented": "oidc", "reason": "no account", "issuer": ISSUER, "subject": "carol-sub"}


def test_a_revoked_account_cannot_log_in(site: Site) -> None:
    revoke_account(site.store, "ana")
    answer = _log_in(site)
    assert answer.status_code == 403 and "revoked" in answer.text
    assert _actions(site.store, LOGIN_FAILED)[0].detail["reason"] == "account revoked"


# --------------------------------------------------------------------------- the callback itself


def test_a_callback_without_this_browsers_login_or_replayed_is_400(site: Site) -> None:
    callback = site.provider.authorize(_start(site)).removeprefix(LOCAL)
    # another browser (no login cookie) cannot complete it
    stranger = TestClient(site.client.app, base_url=LOCAL, follow_redirects=False)  # its own cookie jar
    assert stranger.get(callback).status_code == 400
    assert site.client.get(callback).status_code == 303
    assert site.client.get(callback).status_code == 400  # once only
    assert _actions(site.store, LOGIN_FAILED) == []  # neither is a login attempt of this browser's


def test_a_code_the_provider_refuses_is_403_and_a_provider_in_trouble_502(site: Site) -> None:
    callback = site.provider.authorize(_start(site))
    forged = re.sub(r"code=[^&]+", "code=not-a-code-it-issued", callback).removeprefix(LOCAL)
    refused = site.client.get(forged)
    assert refused.status_code == 403 and "refused the login" in refused.text
    site.provider.token_status = 503
    assert _log_in(site).status_code == 502


def test_an_error_answer_or_another_issuers_answer_is_refused(site: Site) -> None:
    state = parse_qs(urlsplit(_start(site)).query)["state"][0]
    denied = site.client.get("/auth/callback", params={"state": state, "error": "access_denied",
                                                       "error_description": "<b>no</b>"})
    assert denied.status_code == 403 and "access_denied" in denied.text and "<b>no</b>" not in denied.text
    callback = site.provider.authorize(_start(site)).removeprefix(LOCAL)
    mixed_up = callback.replace(quote(ISSUER, safe=""), quote("https://evil.example.org", safe=""))
    assert mixed_up != callback and site.client.get(mixed_up).status_code == 400


def test_a_discovery_document_of_another_issuer_is_a_clear_502(site: Site) -> None:
    site.provider.doc_issuer = "https://idp.example.org/other"
    answer = site.client.get("/auth/login")
    assert answer.status_code == 502 and "give --oidc-issuer exactly as the provider names itself" in answer.text


def test_without_a_provider_the_login_routes_are_404_and_the_login_page_offers_the_token_only(
        tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    add_account(RunStore(url), "ana", "north", "member")
    with TestClient(create_app(url), base_url=LOCAL, follow_redirects=False) as client:
        assert client.get("/auth/login").status_code == 404
        assert client.get("/auth/callback?code=x&state=y").status_code == 404
        page = client.get("/")
        assert page.status_code == 401 and "/auth/login" not in page.text and 'name="token"' in page.text


def test_the_login_page_links_to_the_provider_with_the_page_to_come_back_to(site: Site) -> None:
    page = site.client.get(f"/runs/{site.run_id}")
    assert page.status_code == 401
    assert f'href="/auth/login?next=/runs/{site.run_id}"' in page.text or \
        f'href="/auth/login?next=%2Fruns%2F{site.run_id}"' in page.text


@pytest.mark.parametrize("value", ["//evil.example.org/x", "https://evil.example.org", "/\\evil.example.org",
                                   "javascript:alert(1)", "", "/" + "a" * 3000, "/ok\nLocation: x"],
                         ids=["scheme-relative", "absolute", "backslash", "javascript", "empty", "huge", "newline"])
def test_the_page_to_come_back_to_is_a_path_of_this_dashboard_only(value: str) -> None:
    assert safe_next(value) == "/"
    assert safe_next("/runs/abc?status=finished") == "/runs/abc?status=finished"


#: What a careless user, a broken provider or an attacker may put in the callback's address.
GARBAGE = st.one_of(st.text(max_size=200), st.text(min_size=3000, max_size=12000),
                    st.binary(max_size=200).map(lambda b: b.decode("latin-1")))


def _raw_get(app: Any, path: str, query: bytes, cookie: str = "") -> int:
    """One GET through the ASGI app with a query string of any bytes (a client would send them)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"host", b"127.0.0.1")] + ([(b"cookie", cookie.encode("latin-1"))] if cookie else [])
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query, "headers": headers,
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    return int(next(m for m in sent if m["type"] == "http.response.start")["status"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(code=GARBAGE, state=GARBAGE, extra=GARBAGE, with_login=st.booleans(), raw=st.binary(max_size=300))
def test_garbage_in_the_callback_is_4xx_never_5xx(site: Site, code: str, state: str, extra: str, with_login: bool,
                                                 raw: bytes) -> None:
    cookie = ""
    if with_login:  # a login of this browser is pending: garbage reaches the code exchange
        state = parse_qs(urlsplit(_start(site)).query)["state"][0]
        cookie = f"quorum_login={state}"
    for query in (f"code={quote(code, safe='')}&state={quote(state, safe='')}".encode(),
                  f"state={quote(state, safe='')}&error={quote(extra, safe='')}&iss={quote(extra, safe='')}".encode(),
                  raw, b"code=%ff%fe&state=%c3%28&" + raw):
        status = _raw_get(site.client.app, "/auth/callback", query, cookie)
        assert 400 <= status < 500, (query[:80], status)
    assert _raw_get(site.client.app, "/auth/login", b"next=" + quote(extra, safe="").encode()) in (302,)


# --------------------------------------------------------------------------- settings and accounts


@pytest.mark.parametrize(("issuer", "client_id", "secret", "public_url", "message"), [
    ("http://idp.example.org", "c", None, None, "https is required beyond loopback"),
    ("idp.example.org", "c", None, None, "the provider's issuer URL"),
    ("https://idp.example.org?x=1", "c", None, None, "without a query or fragment"),
    ("https://idp.example.org", "", None, None, "--oidc-client-id ''"),
    ("https://idp.example.org", " c", None, None, "--oidc-client-id ' c'"),
    ("https://idp.example.org", "c", "  ", None, "QUORUM_OIDC_CLIENT_SECRET is blank"),
    ("https://idp.example.org", "c", None, "http://quorum.example.org", "--public-url"),
], ids=["plain-http", "no-scheme", "query", "empty-client", "spaced-client", "blank-secret", "plain-public-url"])
def test_bad_settings_are_refused_naming_them(issuer: str, client_id: str, secret: str | None, public_url: str | None,
                                              message: str) -> None:
    with pytest.raises(OidcConfigError, match=re.escape(message)):
        oidc_settings(issuer, client_id, secret, public_url)
    assert oidc_settings("http://127.0.0.1:9999", "c").issuer == "http://127.0.0.1:9999"  # loopback: http is fine


def test_the_client_secret_is_never_in_a_settings_repr() -> None:
    assert CLIENT_SECRET not in repr(oidc_settings(ISSUER, CLIENT_ID, CLIENT_SECRET))


def test_the_dashboard_command_refuses_half_an_oidc_setup_in_one_line(tmp_path: Path) -> None:
    from quorum.cli import app

    db = f"sqlite:///{tmp_path / 'q.db'}"
    result = CliRunner().invoke(app, ["dashboard", "--db", db, "--oidc-issuer", ISSUER])
    assert result.exit_code == 2 and "give --oidc-issuer and --oidc-client-id together" in result.output
    result = CliRunner().invoke(app, ["dashboard", "--db", db, "--oidc-issuer", "http://idp.example.org",
                                      "--oidc-client-id", "c"])
    assert result.exit_code == 2 and "https is required beyond loopback" in result.output
    assert "QUORUM_OIDC_CLIENT_SECRET" in CliRunner().invoke(app, ["dashboard", "--help"]).output


def test_accounts_are_linked_to_one_identity_each(tmp_path: Path) -> None:
    from quorum.cli import app

    db = f"sqlite:///{tmp_path / 'q.db'}"
    result = CliRunner().invoke(app, ["accounts", "add", "ana", "--org", "north", "--no-token", "--oidc-issuer",
                                      ISSUER, "--oidc-subject", "ana-sub", "--db", db])
    assert result.exit_code == 0 and f"logs in at {ISSUER} as ana-sub" in result.output
    store = RunStore(db)
    found = account_for_identity(store, ISSUER, "ana-sub")
    assert found is not None and found.name == "ana"
    assert account_for_identity(store, "https://other.example.org", "ana-sub") is None  # the issuer counts too
    with pytest.raises(AccountError, match="account 'ana''s already"):
        add_account(store, "ana2", "north", "member", issuer=ISSUER, subject="ana-sub")
    with pytest.raises(AccountError, match="both the OpenID issuer and the subject"):
        add_account(store, "bob", "north", "member", issuer=ISSUER)
    with pytest.raises(AccountError, match="OpenID subject 'a b'"):
        add_account(store, "bob", "north", "member", issuer=ISSUER, subject="a b")
    listed = CliRunner().invoke(app, ["accounts", "list", "--db", db, "--json"]).output
    assert '"oidc_issuer": "https://idp.example.org", "oidc_subject": "ana-sub"' in listed
