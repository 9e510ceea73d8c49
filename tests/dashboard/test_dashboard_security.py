"""Escaping of store data, the access token, and the refusal to bind openly without one."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from dashboard_support import XSS_CLIENT, XSS_NAME, XSS_REASON, FilledStore
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from dashboard.app import create_app
from dashboard.auth import COOKIE, TOKEN_ENV, check_bind, is_loopback
from dashboard.errors import InsecureBind

ESCAPED_NAME = "&lt;script&gt;alert(1)&lt;/script&gt;"


def test_scenario_name_shows_as_text_on_every_page(client: TestClient, filled_store: FilledStore) -> None:
    run = filled_store.xss_run
    for path in ("/", f"/runs/{run}", f"/runs/{run}/rounds/1", "/clients", f"/clients?run={run}"):
        page = client.get(path).text
        assert "<script>alert" not in page, path
        assert "<img src=x" not in page, path
    assert ESCAPED_NAME in client.get("/").text
    assert ESCAPED_NAME in client.get(f"/runs/{run}").text


def test_client_label_and_reason_are_escaped(client: TestClient, filled_store: FilledStore) -> None:
    page = client.get(f"/runs/{filled_store.xss_run}/rounds/1").text
    assert "&lt;img src=x onerror=alert(2)&gt;" in page
    assert "rejected at train: &lt;script&gt;alert(3)&lt;/script&gt;" in page


def test_data_embedded_for_charts_cannot_close_its_script_tag(client: TestClient,
                                                               filled_store: FilledStore) -> None:
    page = client.get(f"/runs/{filled_store.xss_run}").text
    start = page.index('id="run-data">') + len('id="run-data">')
    embedded = page[start:page.index("</script>", start)]
    assert json.loads(embedded)["run"]["name"] == XSS_NAME
    assert "<" not in embedded


def test_the_api_returns_the_raw_text(client: TestClient, filled_store: FilledStore) -> None:
    clients = client.get(f"/api/runs/{filled_store.xss_run}/rounds/1/clients").json()
    assert client.get(f"/api/runs/{filled_store.xss_run}").json()["name"] == XSS_NAME
    assert (clients[0]["client"], clients[0]["reason"]) == (XSS_CLIENT, XSS_REASON)


def test_pages_forbid_inline_scripts(client: TestClient) -> None:
    headers = client.get("/").headers
    assert "script-src 'self';" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.20", False), ("example.org", False), ("", False)])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_check_bind_needs_a_token_beyond_loopback() -> None:
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "s3cret")
    with pytest.raises(InsecureBind, match="--token"):
        check_bind("0.0.0.0", None)
    with pytest.raises(InsecureBind, match=TOKEN_ENV):
        check_bind("10.1.2.3", "")


def test_cli_refuses_an_open_bind_without_a_token(filled_store: FilledStore) -> None:
    from quorum.cli import app

    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    result = CliRunner().invoke(app, ["dashboard", "--db", filled_store.url, "--host", "0.0.0.0"], env=env)
    assert result.exit_code == 2
    assert "--token" in result.output and TOKEN_ENV in result.output


@pytest.fixture(scope="module")
def guarded(filled_store: FilledStore) -> Iterator[TestClient]:
    with TestClient(create_app(filled_store.url, token="s3cret"), follow_redirects=False) as test_client:
        yield test_client


def test_token_is_required_for_api_and_pages(guarded: TestClient) -> None:
    api = guarded.get("/api/runs")
    page = guarded.get("/")
    assert api.status_code == 401 and api.headers["www-authenticate"] == "Bearer"
    assert page.status_code == 401 and 'name="token"' in page.text
    assert guarded.get("/metrics").status_code == 401
    assert guarded.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert guarded.get("/static/dashboard.css").status_code == 200


def test_bearer_token_opens_the_api(guarded: TestClient) -> None:
    assert guarded.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert guarded.get("/metrics", headers={"authorization": "bearer s3cret"}).status_code == 200


def test_query_token_sets_a_cookie_and_leaves_the_address(guarded: TestClient) -> None:
    response = guarded.get("/clients?token=s3cret&run=x")
    assert response.status_code == 303 and response.headers["location"] == "/clients?run=x"
    assert f"{COOKIE}=" in response.headers["set-cookie"] and "HttpOnly" in response.headers["set-cookie"]
    assert "s3cret" not in response.headers["set-cookie"]
    assert guarded.get("/").status_code == 200  # the client kept the cookie
    guarded.cookies.clear()
    assert guarded.get("/api/runs", headers={"Cookie": f"{COOKIE}=forged"}).status_code == 401
