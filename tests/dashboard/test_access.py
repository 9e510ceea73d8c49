"""Accounts and roles on every route of the dashboard (issue #48): who may call what, and see which clients.

Every route comes from the app object itself, so a route added without a rule
fails :func:`test_every_route_of_the_app_has_a_rule`; every route is then
called by every role of both organisations, and no answer to a member or a
lead holds a per-client row of the other organisation's device.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.routing import Mount

from core.records import ClientRecord, RoundRecord
from core.strategy import ServerState
from dashboard.access import RULES, WRITES, iter_routes
from dashboard.app import create_app
from runstore.accounts import add_account, authenticate, issue_token, revoke_account, revoke_token
from runstore.store import RunStore

#: Each organisation's device: node id, name, and a value only its own rows carry (its reply's reason).
NORTH = ("4242001", "dev-north", "north-only-row-7731")
SOUTH = ("9191002", "dev-south", "south-only-row-5519")
#: Role x organisation: the accounts the tests act as. The north lead submitted the run.
ACCOUNTS = (("admin-a", "hq", "admin"), ("lead-n", "north", "lead"), ("lead-s", "south", "lead"),
            ("member-n", "north", "member"), ("member-s", "south", "member"), ("scraper", "hq", "service"))
SHARED_TOKEN = "shared-secret-token-123"


@dataclass
class Site:
    url: str
    run_id: str
    tokens: dict[str, str]
    app: Any


def _state(round_: int) -> ServerState:
    return ServerState(params=np.arange(3, dtype=np.float32), round=round_)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    url = f"sqlite:///{tmp_path_factory.mktemp('access') / 'quorum.db'}"
    store = RunStore(url)
    run_id = store.create_run(name="shared", scenario={"name": "shared"}, seed=0, strategy="fedavg", rounds=1,
                              engine="deployment",
                              info={"devices": {NORTH[0]: NORTH[1], SOUTH[0]: SOUTH[1]},
                                    "orgs": {NORTH[1]: "north", SOUTH[1]: "south"}, "submitted_by": "lead-n"})
    clients = [ClientRecord(node, "rejected", stage="train", reason=marker) for node, _, marker in (NORTH, SOUTH)]
    store.commit_round(run_id, RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=2, clients=clients),
                       _state(1))
    store.set_status(run_id, "degraded")
    tokens = {}
    for name, org, role in ACCOUNTS:
        add_account(store, name, org, role)
        tokens[name] = issue_token(store, name, days=1)
    return Site(url=url, run_id=run_id, tokens=tokens, app=create_app(url, token=SHARED_TOKEN))


def _call(app: Any, path: str, headers: dict[str, str] | None = None, query: str = "") -> tuple[int, bytes]:
    """One GET through the whole ASGI app; a streaming answer is cut after its first part (a client leaving)."""
    sent: list[dict[str, Any]] = []
    asked = 0
    started, answered = asyncio.Event(), asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        if asked == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await started.wait()  # the client leaves once the answer began (a stream would go on forever)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.start":
            started.set()
        elif message["type"] == "http.response.body" and b"text/event-stream" in dict(sent[0]["headers"]).get(
                b"content-type", b""):
            answered.set()  # a stream's first part: its answer (it would go on until the run ends, or forever)

    async def run() -> None:
        task = asyncio.ensure_future(app(scope, receive, send))
        first = asyncio.ensure_future(answered.wait())
        await asyncio.wait({task, first}, timeout=20, return_when=asyncio.FIRST_COMPLETED)
        first.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    raw = [(k.lower().encode("latin-1"), v.encode("utf-8", "surrogatepass")) for k, v in
           {"host": "127.0.0.1", **(headers or {})}.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query.encode("latin-1"),
             "headers": raw, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80)}
    asyncio.run(run())
    start = next(m for m in sent if m["type"] == "http.response.start")
    return int(start["status"]), b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _routes(app: Any) -> list[str]:
    return sorted({r.path for r in iter_routes(app.routes) if not isinstance(r, Mount)})


def _concrete(template: str, run_id: str, client: str) -> str:
    return template.replace("{run_id}", run_id).replace("{number}", "1").replace("{client}", client)


def _methods(app: Any) -> set[str]:
    """Every ``METHOD template`` the app answers (HEAD goes with GET)."""
    return {f"{m} {r.path}" for r in iter_routes(app.routes) if not isinstance(r, Mount)
            for m in (getattr(r, "methods", None) or {"GET"}) if m != "HEAD"}


def test_every_route_of_the_app_has_a_rule(site: Site) -> None:
    # the app's own routes (its routers flattened), against the rules' tables: both ways
    routes = _routes(site.app)
    assert len(routes) >= 20
    reads = {m.split(" ", 1)[1] for m in _methods(site.app) if m.startswith("GET ")}
    writes = {m for m in _methods(site.app) if not m.startswith("GET ")}
    assert reads - set(RULES) == set(), "a GET route without an access rule (dashboard/access.py RULES)"
    assert writes - set(WRITES) == set(), "a write route without an access rule (dashboard/access.py WRITES)"
    assert set(RULES) - set(routes) == set(), "a rule for a route that no longer exists"
    assert set(WRITES) - writes == set(), "a write rule for a route that no longer exists"


#: Routes anyone may call (RULES: ANYONE), and what a GET answers on this site, which has no identity provider:
#: the login and its callback are 404; logout is POST only (tests/dashboard/test_oidc.py logs in and out).
OPEN = {"/auth/login": 404, "/auth/callback": 404, "/auth/logout": 405}
#: Write-only routes (POST, dashboard/submit.py): a GET of one has no rule, and is refused before the app sees it.
WRITE_ONLY = ("/api/runs/{run_id}/stop", "/api/runs/{run_id}/resume")


def _expected(template: str, role: str, name: str) -> int:
    if template in OPEN:
        return OPEN[template]
    if template in WRITE_ONLY:
        return 403
    if template == "/api/submissions/{submission}":  # leads and admins; "{submission}" names none
        return 404 if role in ("admin", "lead") else 403
    if template == "/metrics":
        return 200 if role in ("admin", "service") else 403
    if role == "service":
        return 403
    if template == "/api/runs/{run_id}/checkpoint":
        return 200 if role == "admin" or name == "lead-n" else 403
    return 308 if template == "/runs" else 200  # /runs is an alias of /


#: Routes whose answers hold per-client rows (to look for the other organisation's in them).
PER_CLIENT = ("/api/runs/{run_id}/rounds/{number}/clients", "/api/clients", "/api/clients/{client}",
              "/runs/{run_id}/rounds/{number}", "/clients", "/clients/{client}")


@pytest.mark.parametrize("account", [a[0] for a in ACCOUNTS])
def test_each_role_of_each_organisation_gets_what_its_rule_allows_and_no_other_sites_rows(
        site: Site, account: str) -> None:
    _, org, role = next(a for a in ACCOUNTS if a[0] == account)
    headers = {"authorization": f"Bearer {site.tokens[account]}"}
    own = {"north": NORTH, "south": SOUTH}.get(org)
    other = {"north": SOUTH, "south": NORTH}.get(org)
    for template in _routes(site.app):
        client = (own or NORTH)[0]
        query = "since=0" if template == "/api/events" else ""  # every run's event at once, not only new ones
        status, body = _call(site.app, _concrete(template, site.run_id, client), headers, query)
        assert status == _expected(template, role, account), (template, account, status, body[:200])
        if role in ("lead", "member") and other is not None:
            # another site's rows: neither its device's node id in a row nor the marker its row carries
            assert other[2].encode() not in body, (template, account)
    if role in ("lead", "member"):
        rows = _call(site.app, f"/api/runs/{site.run_id}/rounds/1/clients", headers)[1]
        assert own is not None and own[2].encode() in rows  # its own site's row is there
        assert other is not None and _call(site.app, f"/api/clients/{other[0]}", headers)[0] == 404
        listed = _call(site.app, "/api/clients", headers, f"run_id={site.run_id}")[1].decode()
        assert re.findall(r'"client":"(\d+)"', listed) == [own[0]]


def test_an_admin_sees_both_sites_rows(site: Site) -> None:
    # the positive control of the filter: the same routes, unfiltered
    for who in ({"authorization": f"Bearer {site.tokens['admin-a']}"}, {"authorization": f"Bearer {SHARED_TOKEN}"}):
        status, body = _call(site.app, f"/api/runs/{site.run_id}/rounds/1/clients", who)
        assert status == 200 and NORTH[2].encode() in body and SOUTH[2].encode() in body
        status, page = _call(site.app, f"/runs/{site.run_id}/rounds/1", who)
        assert status == 200 and NORTH[2].encode() in page and SOUTH[2].encode() in page


def test_without_a_token_every_route_but_static_files_is_401(site: Site) -> None:
    for template in _routes(site.app):
        assert _call(site.app, _concrete(template, site.run_id, NORTH[0]))[0] == OPEN.get(template, 401), template
    assert _call(site.app, "/static/style.css")[0] in (200, 404)  # never asks for a token


def test_a_query_token_becomes_a_session_cookie_holding_its_hash_never_the_token(site: Site) -> None:
    token = site.tokens["member-n"]
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": "/", "raw_path": b"/", "root_path": "",
                 "query_string": f"token={token}&status=finished".encode(), "headers": [(b"host", b"127.0.0.1")],
                 "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80)}
        await site.app(scope, receive, send)

    asyncio.run(run())
    start = sent[0]
    headers = dict(start["headers"])
    assert start["status"] == 303 and headers[b"location"] == b"/?status=finished"
    cookie = headers[b"set-cookie"].decode()
    value = cookie.split(";")[0].split("=", 1)[1]
    assert token not in cookie and re.fullmatch(r"[0-9a-f]{64}", value) and "HttpOnly" in cookie
    # and the cookie alone lets the member in, as the member
    status, body = _call(site.app, f"/api/runs/{site.run_id}/rounds/1/clients",
                         {"cookie": f"quorum_session={value}"})
    assert status == 200 and NORTH[2].encode() in body and SOUTH[2].encode() not in body


def test_revoked_and_expired_tokens_are_refused(tmp_path: Path) -> None:
    store = RunStore(f"sqlite:///{tmp_path / 'tokens.db'}")
    add_account(store, "ana", "north", "member")
    first, second = issue_token(store, "ana", days=1), issue_token(store, "ana", days=1)
    assert authenticate(store, first) is not None
    assert authenticate(store, first, now=time.time() + 86400 + 1) is None  # a day and a second later
    assert revoke_token(store, first[:12]) == "ana"
    assert authenticate(store, first) is None and authenticate(store, second) is not None
    assert revoke_account(store, "ana") == 1  # the one token still live
    assert authenticate(store, second) is None


#: What a careless user or an attacker may send: any text, huge, or bytes outside UTF-8.
GARBAGE = st.one_of(st.text(max_size=300), st.text(min_size=5000, max_size=20000),
                    st.binary(max_size=200).map(lambda b: b.decode("latin-1")))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=GARBAGE, where=st.sampled_from(["bearer", "authorization", "cookie", "session", "query"]))
def test_garbage_credentials_are_401_never_5xx(site: Site, value: str, where: str) -> None:
    value = value.replace("\r", "").replace("\n", "")  # a header cannot hold a line break
    headers, query = {}, ""
    if where == "bearer":
        headers["authorization"] = f"Bearer {value}"
    elif where == "authorization":
        headers["authorization"] = value
    elif where == "cookie":
        headers["cookie"] = value
    elif where == "session":
        headers["cookie"] = f"quorum_session={value}"
    else:
        from urllib.parse import quote

        query = f"token={quote(value, safe='')}"
    status, _ = _call(site.app, f"/api/runs/{site.run_id}", headers, query)
    assert status == 401 or (status == 200 and value.strip() in (SHARED_TOKEN, *site.tokens.values()))


def test_logins_failed_logins_and_model_downloads_are_in_the_audit_trail(site: Site) -> None:
    from runstore.audit import DOWNLOAD_CHECKPOINT, LOGIN, LOGIN_FAILED, rows, verify

    store = RunStore(site.url)
    before = {a: len(rows(store, limit=10_000, action=a)) for a in (LOGIN, LOGIN_FAILED, DOWNLOAD_CHECKPOINT)}
    forged = "qrm_" + "A" * 43

    # Execute: a login by query token, a forged bearer token, a model download by the run's lead, a refused one
    _call(site.app, "/", query=f"token={site.tokens['member-n']}")
    assert _call(site.app, f"/api/runs/{site.run_id}", {"authorization": f"Bearer {forged}"})[0] == 401
    assert _call(site.app, f"/api/runs/{site.run_id}/checkpoint",
                 {"authorization": f"Bearer {site.tokens['lead-n']}"})[0] == 200
    assert _call(site.app, f"/api/runs/{site.run_id}/checkpoint",
                 {"authorization": f"Bearer {site.tokens['member-s']}"})[0] == 403

    # Assert: one row each, by whom, never holding a token; the chain verifies
    login = rows(store, limit=10_000, action=LOGIN)
    failed = rows(store, limit=10_000, action=LOGIN_FAILED)
    downloads = rows(store, limit=10_000, action=DOWNLOAD_CHECKPOINT)
    assert (len(login), len(failed), len(downloads)) == (before[LOGIN] + 1, before[LOGIN_FAILED] + 1,
                                                        before[DOWNLOAD_CHECKPOINT] + 1)
    assert (login[0].actor, login[0].org) == ("member-n", "north")
    assert failed[0].actor == "anonymous" and failed[0].detail["presented"] == "bearer"
    assert (downloads[0].actor, downloads[0].target, downloads[0].detail) == ("lead-n", site.run_id, {"round": 1})
    everything = repr([r.detail for r in rows(store, limit=10_000)])
    assert forged not in everything and not any(t in everything for t in site.tokens.values())
    assert verify(store).ok


def test_a_write_bucket_gives_its_burst_then_one_token_per_refill() -> None:
    from dashboard.access import Buckets

    now = [100.0]
    buckets = Buckets(burst=3, rate=0.5, clock=lambda: now[0])
    assert [buckets.take("lead-n") for _ in range(4)] == [True, True, True, False]
    assert buckets.take("lead-s")  # another account's bucket is its own
    now[0] += 1.9  # 0.95 of a token since it emptied: not yet
    assert not buckets.take("lead-n")
    now[0] += 0.2  # 1.05 in all: one change, then none
    assert buckets.take("lead-n") and not buckets.take("lead-n")
    now[0] += 1000.0  # a long pause refills to the burst, not beyond
    assert [buckets.take("lead-n") for _ in range(4)] == [True, True, True, False]


def test_an_accounts_only_dashboard_never_falls_back_to_the_open_loopback_mode(tmp_path: Path) -> None:
    from dashboard.auth import check_bind
    from dashboard.errors import InsecureBind

    url = f"sqlite:///{tmp_path / 'only.db'}"
    store = RunStore(url)
    add_account(store, "ana", "north", "admin")
    token = issue_token(store, "ana", days=1)
    only, open_ = create_app(url, accounts_only=True), create_app(url)

    # with a live account both ask for a token; with none left, only the open one lets this machine in
    assert _call(only, "/api/runs")[0] == _call(open_, "/api/runs")[0] == 401
    assert _call(only, "/api/runs", {"authorization": f"Bearer {token}"})[0] == 200
    revoke_account(store, "ana")
    open_ = create_app(url)  # (an app looks its accounts up every 2 s: a new one sees the revocation at once)
    assert _call(open_, "/api/runs")[0] == 200  # the one-person setup: every account revoked
    assert _call(only, "/api/runs")[0] == 401  # never, here
    # and a Host of another machine reaches the accounts-only app (no loopback guard), still without access
    assert _call(only, "/api/runs", {"host": "quorum.example.org"})[0] == 401
    assert _call(open_, "/api/runs", {"host": "quorum.example.org"})[0] == 400
    check_bind("0.0.0.0", None, accounts=True)
    with pytest.raises(InsecureBind, match="--accounts"):
        check_bind("0.0.0.0", None)


def test_dashboard_accounts_refuses_a_store_without_an_account(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from quorum.cli import app as cli

    db = f"sqlite:///{tmp_path / 'none.db'}"
    result = CliRunner().invoke(cli, ["dashboard", "--db", db, "--accounts", "--port", "1"])
    assert result.exit_code == 2 and "has no account" in " ".join(result.output.split())
