"""In Chromium, a user logs in through a real OpenID provider and sees only what its role allows (issue #48).

The suite starts panva's ``oidc-provider`` (tests/oidc/provider.mjs, installed by
``make oidc-provider`` from the npm registry, run with the machine's Node.js)
and ``quorum dashboard --oidc-issuer ... --oidc-client-id ...`` (the client
secret in ``QUORUM_OIDC_CLIENT_SECRET``), each on 127.0.0.1 on a port picked
here, both stopped by PID. Debian's Chromium, driven by Playwright, goes
through the provider's own sign-in and consent pages; every address off this
machine (the provider's page asks for a web font) is refused, so nothing
leaves it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from dashboard_support import CHROMIUM, CHROMIUM_ARGS, ROOT, free_port, stop
from playwright.sync_api import BrowserContext, Page, Route, sync_playwright

from runstore.accounts import add_account
from runstore.audit import LOGIN, LOGIN_FAILED, LOGOUT, rows, verify
from runstore.store import RunStore
from tests.conftest import wait_for

NODE = shutil.which("node")
PROVIDER = ROOT / "tests" / "oidc"
CLIENT_ID = "quorum-dashboard"
CLIENT_SECRET = "e2e-client-secret-5b1f0c7d9a"
#: The provider's users: ana has a Quorum account (a member of north), carol has none.
USERS = {"ana": {"password": "ana-password-1", "email": "ana@north.example.org"},
         "carol": {"password": "carol-password-2", "email": "carol@south.example.org"}}
RUN_NAME = "north-visible-run"

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not on PATH (make system)"),
              pytest.mark.skipif(NODE is None, reason="Node.js is not on PATH: the OpenID provider runs on it")]


@dataclass(frozen=True)
class Stack:
    base: str
    issuer: str
    store: RunStore
    run_id: str
    logs: tuple[Path, Path]

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs)


def _answers(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5, follow_redirects=False)
    except httpx.HTTPError:
        return None


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    if not (PROVIDER / "node_modules" / "oidc-provider").is_dir():
        pytest.fail("the OpenID provider is not installed: run `make oidc-provider` (npm ci in tests/oidc)")
    dash_port, idp_port = free_port(), free_port()
    base, issuer = f"http://127.0.0.1:{dash_port}", f"http://127.0.0.1:{idp_port}"
    config = tmp_path / "provider.json"
    config.write_text(json.dumps({"port": idp_port, "client_id": CLIENT_ID, "client_secret": CLIENT_SECRET,
                                  "redirect_uri": f"{base}/auth/callback", "users": USERS}))
    db_url = f"sqlite:///{tmp_path / 'quorum.db'}"
    store = RunStore(db_url)
    run_id = store.create_run(name=RUN_NAME, scenario={"name": RUN_NAME}, seed=0, strategy="fedavg", rounds=1)
    add_account(store, "ana", "north", "member", issuer=issuer, subject="ana")
    env = {k: v for k, v in os.environ.items() if k != "QUORUM_DASHBOARD_TOKEN" and not k.lower().endswith("_proxy")}
    logs = (tmp_path / "provider.log", tmp_path / "dashboard.log")
    with ExitStack() as cleanup:
        idp_log = cleanup.enter_context(open(logs[0], "w"))
        dash_log = cleanup.enter_context(open(logs[1], "w"))
        provider = subprocess.Popen([NODE, str(PROVIDER / "provider.mjs"), str(config)], cwd=PROVIDER, env=env,
                                    stdout=idp_log, stderr=subprocess.STDOUT)
        cleanup.callback(stop, provider)
        dashboard = subprocess.Popen(
            [sys.executable, "-m", "dashboard", "--db", db_url, "--host", "127.0.0.1", "--port", str(dash_port),
             "--oidc-issuer", issuer, "--oidc-client-id", CLIENT_ID],
            cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), "QUORUM_OIDC_CLIENT_SECRET": CLIENT_SECRET},
            stdout=dash_log, stderr=subprocess.STDOUT)
        cleanup.callback(stop, dashboard)
        found = Stack(base=base, issuer=issuer, store=store, run_id=run_id, logs=logs)
        wait_for(lambda: (r := _answers(f"{issuer}/.well-known/openid-configuration")) and r.status_code == 200,
                 30, lambda: f"the OpenID provider to answer\n{found.tail()}", poll_s=0.1)
        wait_for(lambda: (r := _answers(f"{base}/")) and r.status_code == 401, 45,
                 lambda: f"the dashboard to answer\n{found.tail()}", poll_s=0.2)
        yield found


def _offline(context: BrowserContext) -> None:
    """Refuse every request off this machine (the provider's page asks for a web font)."""
    def route(r: Route) -> None:
        if r.request.url.startswith("http://127.0.0.1:"):
            r.continue_()
        else:
            r.abort()
    context.route("**/*", route)


def _sign_in(page: Page, stack: Stack, login: str, password: str) -> None:
    """On the provider's own pages: sign in, then consent."""
    page.wait_for_url(re.compile(rf"^{re.escape(stack.issuer)}/interaction/"), timeout=20_000)
    page.fill('input[name="login"]', login)
    page.fill('input[name="password"]', password)
    with page.expect_navigation(timeout=20_000):
        page.click("button[type=submit]")
    if page.locator('input[name="prompt"][value="consent"]').count():  # the consent page, the first time
        page.click("button[type=submit]")


def test_a_member_logs_in_through_the_real_provider_and_sees_only_what_its_role_allows(stack: Stack) -> None:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context()
            _offline(context)
            page = context.new_page()

            # Execute: the run's page asks for a login; the provider's pages log ana in
            first = page.goto(f"{stack.base}/runs/{stack.run_id}")
            assert first is not None and first.status == 401
            page.click("#oidc-login")
            _sign_in(page, stack, "ana", USERS["ana"]["password"])
            page.wait_for_url(f"{stack.base}/runs/{stack.run_id}", timeout=20_000)

            # Assert: back on the page ana wanted, as a member: the runs, but not /metrics
            assert RUN_NAME in page.content()
            assert page.goto(f"{stack.base}/").status == 200 and RUN_NAME in page.content()
            metrics = page.goto(f"{stack.base}/metrics")
            assert metrics is not None and metrics.status == 403
            session = next(c for c in context.cookies() if c["name"] == "quorum_session")
            assert session["httpOnly"] and session["sameSite"] == "Lax" and re.fullmatch(r"[0-9a-f]{64}",
                                                                                       session["value"])

            # and logs out: the session is revoked, the login page is back
            page.goto(f"{stack.base}/")
            with page.expect_navigation(url=f"{stack.base}/"):
                page.click("#logout")
            assert page.locator("#oidc-login").is_visible()
            replayed = httpx.get(f"{stack.base}/api/runs", cookies={"quorum_session": session["value"]}, timeout=5)
            assert replayed.status_code == 401
        finally:
            browser.close()
    (login,) = rows(stack.store, limit=100, action=LOGIN)
    assert (login.actor, login.detail["via"], login.detail["subject"]) == ("ana", "oidc", "ana")
    assert rows(stack.store, limit=100, action=LOGOUT)[0].actor == "ana"
    assert verify(stack.store).ok


def test_someone_without_an_account_and_a_wrong_password_get_no_session(stack: Stack) -> None:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context()
            _offline(context)
            page = context.new_page()

            # a wrong password stops at the provider
            page.goto(f"{stack.base}/auth/login")
            _sign_in(page, stack, "ana", "not-her-password")
            assert page.locator("#login-failed").is_visible()

            # carol is the provider's user, but no Quorum account is linked to her: a clear 403
            page.goto(f"{stack.base}/auth/login")
            _sign_in(page, stack, "carol", USERS["carol"]["password"])
            page.wait_for_url(re.compile(rf"^{re.escape(stack.base)}/auth/callback"), timeout=20_000)
            assert "no Quorum account is linked to that identity" in page.content()
            assert "--oidc-subject carol" in page.content()
            assert not any(c["name"] == "quorum_session" for c in context.cookies())
            assert page.goto(f"{stack.base}/").status == 401
        finally:
            browser.close()
    failed = rows(stack.store, limit=100, action=LOGIN_FAILED)
    assert [(r.detail["reason"], r.detail["subject"]) for r in failed] == [("no account", "carol")]
