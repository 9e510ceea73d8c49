"""DNS rebinding (loopback Host headers without a token), HTTPS with the federation's certificates,
the Secure cookie, and the sampled client ids a DP run keeps from viewers."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dashboard_support import ROOT, FilledStore, free_port, stop
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from dashboard.app import create_app
from dashboard.auth import COOKIE, TOKEN_ENV, host_is_loopback
from tests.conftest import wait_for


@pytest.mark.parametrize(("host", "allowed"), [
    ("localhost", True), ("localhost:8765", True), ("LocalHost:1", True), ("127.0.0.1", True),
    ("127.0.0.1:8765", True), ("[::1]", True), ("[::1]:8765", True), ("127.1.2.3:80", True),
    ("evil.example", False), ("evil.example:8765", False), ("127.0.0.1.evil.example", False),
    ("localhost.evil.example:8765", False), ("[::1]evil", False), ("[::1", False), ("::1", False),
    ("localhost:http", False), ("192.168.1.20:8765", False), ("", False)])
def test_host_header_is_loopback(host: str, allowed: bool) -> None:
    assert host_is_loopback(host) is allowed


def test_without_a_token_only_loopback_hosts_are_answered(client: TestClient) -> None:
    # Prepare: the rebinding attacker's request reaches 127.0.0.1 but names its own host
    rebound = client.get("/api/runs", headers={"host": "attacker.example:8765"})
    page = client.get("/", headers={"host": "attacker.example"})
    # Assert
    assert rebound.status_code == 400 and page.status_code == 400
    assert "Host not allowed" in rebound.text and "run" not in rebound.text.replace("runs", "")
    for host in ("localhost:8765", "127.0.0.1", "[::1]:8765"):
        assert client.get("/api/runs", headers={"host": host}).status_code == 200


def test_with_a_token_any_host_may_ask_but_needs_the_token(filled_store: FilledStore) -> None:
    with TestClient(create_app(filled_store.url, token="s3cret"), base_url="http://dash.example") as guarded:
        assert guarded.get("/api/runs").status_code == 401
        assert guarded.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200


@pytest.mark.parametrize(("base", "secure"), [("https://dash.example", True), ("http://dash.example", False)])
def test_session_cookie_is_secure_over_tls(filled_store: FilledStore, base: str, secure: bool) -> None:
    with TestClient(create_app(filled_store.url, token="s3cret"), base_url=base,
                    follow_redirects=False) as guarded:
        cookie = guarded.get("/clients?token=s3cret").headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}=") and "HttpOnly" in cookie
    assert ("; Secure" in cookie) is secure


def _cli(args: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[dict[str, Any]]]:
    import uvicorn

    from quorum.cli import app

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda _app, **kw: calls.append(kw))
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return CliRunner().invoke(app, ["dashboard", *args], env=env), calls


def test_cli_passes_the_certificates_to_uvicorn(filled_store: FilledStore, monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    from deploy.pki import ensure_tls

    files = ensure_tls(tmp_path / "pki", ["127.0.0.1"])
    cert, key = str(files.server_cert), str(files.server_key)
    result, calls = _cli(["--db", filled_store.url, "--host", "0.0.0.0", "--token", "T", "--tls-cert", cert,
                          "--tls-key", key], monkeypatch)
    assert result.exit_code == 0, result.output
    (kw,) = calls
    assert kw["host"] == "0.0.0.0" and kw["ssl_certfile"] == cert and kw["ssl_keyfile"] == key
    assert "https://0.0.0.0:" in result.output


def test_cli_refuses_tls_files_it_cannot_serve_before_announcing_anything(
        filled_store: FilledStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Prepare: a certificate with another pair's key, a file that is not PEM, a missing file
    from deploy.pki import ensure_tls

    one, other = ensure_tls(tmp_path / "a", ["127.0.0.1"]), ensure_tls(tmp_path / "b", ["127.0.0.1"])
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cases = [(one.server_cert, other.server_key, "cannot serve TLS"), (junk, one.server_key, "cannot serve TLS"),
             (tmp_path / "gone.pem", one.server_key, "gone.pem: no such file")]
    for cert, key, said in cases:
        # Execute
        result, calls = _cli(["--db", filled_store.url, "--token", "T", "--tls-cert", str(cert),
                              "--tls-key", str(key)], monkeypatch)
        # Assert: one line, exit 2, no server started, no address announced, no traceback
        assert result.exit_code == 2 and calls == [], result.output
        assert said in result.output and "Quorum dashboard on" not in result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("token", [" ", "", "\t\n", " s3cret", "s3cret "])
def test_cli_refuses_a_blank_token_or_one_with_blanks_around_it(filled_store: FilledStore,
                                                               monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    result, calls = _cli(["--db", filled_store.url, "--token", token], monkeypatch)
    assert result.exit_code == 2 and calls == [], result.output
    assert "--token" in result.output and "Traceback" not in result.output


def test_cli_names_a_store_it_cannot_open_before_announcing_anything(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    (tmp_path / "notes.db").write_text("these are my notes, not a database\n" * 50)
    result, calls = _cli(["--db", f"sqlite:///{tmp_path / 'notes.db'}"], monkeypatch)
    assert result.exit_code == 2 and calls == [], result.output
    assert "notes.db is not an SQLite database" in result.output and "Quorum dashboard on" not in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(("args", "needle"), [
    (["--host", "0.0.0.0", "--token", "T"], "--tls-cert"),           # token in clear off loopback
    (["--host", "0.0.0.0", "--token", "T", "--tls-cert", "C.pem"], "--tls-key"),  # half a pair
])
def test_cli_refuses_plain_http_beyond_loopback(filled_store: FilledStore, monkeypatch: pytest.MonkeyPatch,
                                                args: list[str], needle: str) -> None:
    result, calls = _cli(["--db", filled_store.url, *args], monkeypatch)
    assert result.exit_code == 2 and needle in result.output and not calls


def test_cli_plain_http_beyond_loopback_is_an_explicit_choice(filled_store: FilledStore,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    result, calls = _cli(["--db", filled_store.url, "--host", "0.0.0.0", "--token", "T", "--plain-http"],
                         monkeypatch)
    assert result.exit_code == 0 and calls[0]["ssl_certfile"] is None


@pytest.fixture
def https_dashboard(filled_store: FilledStore, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    from deploy.pki import ensure_tls

    files = ensure_tls(tmp_path / "pki", ["127.0.0.1", "localhost"])
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k != TOKEN_ENV}, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "dashboard.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dashboard", "--db", filled_store.url, "--host", "127.0.0.1",
                                 "--port", str(port), "--token", "s3cret", "--tls-cert", str(files.server_cert),
                                 "--tls-key", str(files.server_key)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"https://127.0.0.1:{port}", files.ca_cert
    finally:
        stop(proc)


@pytest.mark.e2e
def test_dashboard_serves_https_with_the_federation_certificates(https_dashboard: tuple[str, Path]) -> None:
    base, ca = https_dashboard
    trust = ssl.create_default_context(cafile=str(ca))

    def answered() -> httpx.Response | None:
        try:
            return httpx.get(f"{base}/api/runs", headers={"Authorization": "Bearer s3cret"}, verify=trust, timeout=5)
        except httpx.HTTPError:
            return None

    response = wait_for(answered, 45, "the HTTPS dashboard to answer", poll_s=0.2)
    assert response.status_code == 200 and isinstance(response.json(), list)
    with httpx.Client(verify=trust, follow_redirects=False, timeout=5) as browser:
        cookie = browser.get(f"{base}/clients?token=s3cret").headers["set-cookie"]
    assert "; Secure" in cookie
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port gets nothing usable
        httpx.get(base.replace("https://", "http://") + "/api/runs", timeout=5).raise_for_status()


# -- a DP run keeps its sampled client ids from viewers ---------------------------------------------------

def test_dp_round_shows_counts_not_ids(client: TestClient, filled_store: FilledStore) -> None:
    # Prepare: the DP run's round 1 sampled clients 0-3; client 3 dropped (dashboard_support.add_dp_run)
    page = client.get(f"/runs/{filled_store.dp_run}/rounds/1").text
    api = client.get(f"/api/runs/{filled_store.dp_run}/rounds/1/clients")
    one = client.get(f"/api/runs/{filled_store.dp_run}/rounds/1").json()
    # Assert: counts (3 of 4 answered, 1 dropped), no per-client rows or links
    assert "<tr data-client=" not in page and 'id="clients-hidden"' in page and "/clients/0?" not in page
    assert ">3 / 4<" in page
    assert api.status_code == 403 and "differentially private" in api.json()["detail"]
    assert (one["sampled"], one["answered"], one["dropped"]) == (4, 3, 1)


def test_dp_run_is_left_out_of_client_histories(client: TestClient, filled_store: FilledStore) -> None:
    # Prepare: clients "0".."3" took part in the DP run only; the simulated run's clients are node ids
    sim_client = client.get(f"/api/runs/{filled_store.sim_run}/rounds/1/clients").json()[0]["client"]
    # Execute / Assert: the DP run's participants have no visible history at all
    assert client.get("/api/clients/0").status_code == 404
    assert client.get("/clients/0").status_code == 404
    assert client.get(f"/api/clients?run={filled_store.dp_run}").json() == []
    # a run without DP still shows its clients
    history = client.get(f"/api/clients/{sim_client}").json()
    assert history and {row["run_id"] for row in history} == {filled_store.sim_run}


def test_cross_run_client_summary_leaves_dp_runs_out(client: TestClient, filled_store: FilledStore) -> None:
    # Prepare: the per-run summaries of the runs without DP
    sim = {c["client"]: c for c in client.get(f"/api/clients?run={filled_store.sim_run}").json()}
    xss = {c["client"]: c for c in client.get(f"/api/clients?run={filled_store.xss_run}").json()}
    # Execute
    everyone = {c["client"]: c for c in client.get("/api/clients").json()}
    page = client.get("/clients").text
    # Assert: exactly the other runs' clients and counts; the DP run's clients "0".."3" (one round each
    # in each of its 2 rounds) add nothing, also where a label also took part in the simulated run
    assert set(everyone) == set(sim) | set(xss)
    for label, summary in everyone.items():
        parts = [runs[label] for runs in (sim, xss) if label in runs]
        assert summary["rounds"] == sum(p["rounds"] for p in parts)
        assert summary["ok"] == sum(p["ok"] for p in parts) and summary["runs"] == len(parts)
    assert page.count("<tr data-client=") == len(everyone)
