"""Remote run submission on the dashboard (``dashboard/submit.py``, issue #48): who may queue what, and the trail.

The app runs in-process (no socket): a lead's submission is queued and
recorded, a member's is refused and recorded, a cookie session needs the CSRF
header, and nothing a client sends makes the routes answer 5xx.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from dashboard import access
from dashboard.app import create_app
from dashboard.submit import MAX_BODY
from quorum import submit_cli
from quorum.cli import app as cli_app
from runstore.accounts import add_account, issue_session, issue_token
from runstore.audit import RESUME, STOP, SUBMIT, rows
from runstore.store import RunStore
from runstore.submissions import PENDING, attach_run, finish, get, take
from tests.conftest import REPO

with warnings.catch_warnings():  # starlette's import-time deprecation (httpx2), not ours
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

SHARED_TOKEN = "shared-secret-token-123"
QUICKSTART = (REPO / "scenarios" / "quickstart.toml").read_text()
ACCOUNTS = (("admin-a", "hq", "admin"), ("lead-n", "north", "lead"), ("lead-s", "south", "lead"),
            ("member-n", "north", "member"))


@dataclass
class Site:
    store: RunStore
    client: TestClient
    tokens: dict[str, str]
    run_id: str

    def post(self, path: str, who: str, body: Any = None, **kwargs: Any) -> Any:
        headers = {"authorization": f"Bearer {self.tokens[who]}", **kwargs.pop("headers", {})}
        return self.client.post(path, json=body, headers=headers, **kwargs)

    def trail(self, action: str) -> list[Any]:
        return rows(self.store, action=action)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Site]:
    monkeypatch.setattr(access, "WRITE_BURST", 1000)  # the rate limit has a test of its own
    store = RunStore(f"sqlite:///{tmp_path / 'quorum.db'}")
    run_id = store.create_run(name="north's", scenario={"name": "x"}, seed=0, strategy="fedavg", rounds=2,
                              engine="deployment", info={"submitted_by": "lead-n", "federation": "fed"})
    tokens = {}
    for name, org, role in ACCOUNTS:
        add_account(store, name, org, role)
        tokens[name] = issue_token(store, name, days=1)
    app = create_app(f"sqlite:///{tmp_path / 'quorum.db'}", token=SHARED_TOKEN)
    with TestClient(app) as client:
        yield Site(store=store, client=client, tokens=tokens, run_id=run_id)
    store.close()


def test_a_leads_submission_is_queued_and_recorded(site: Site) -> None:
    # Execute
    answer = site.post("/api/runs", "lead-n", {"scenario": QUICKSTART})
    # Assert: 202 with the submission's id; queued as the lead's; one audit row naming it
    assert answer.status_code == 202, answer.text
    submission = answer.json()["submission"]
    queued = get(site.store, submission)
    assert queued is not None and (queued.account, queued.org, queued.kind, queued.status) == (
        "lead-n", "north", "submit", PENDING)
    assert queued.scenario is not None and queued.scenario["name"] == "quickstart"
    [row] = site.trail(SUBMIT)
    assert (row.actor, row.org, row.detail) == ("lead-n", "north", {"allowed": True, "submission": submission})
    # its outcome: the lead's to read (and an admin's), nobody else's
    status = site.client.get(f"/api/submissions/{submission}", headers={"authorization":
                                                                        f"Bearer {site.tokens['lead-n']}"})
    assert status.status_code == 200 and status.json()["status"] == PENDING
    for other in ("lead-s", "member-n"):
        got = site.client.get(f"/api/submissions/{submission}",
                              headers={"authorization": f"Bearer {site.tokens[other]}"})
        assert got.status_code in (403, 404), other
    taken = take(site.store, "agg", "fed")
    assert taken is not None
    finish(site.store, taken.id, True, flower_run_id=5)
    done = site.client.get(f"/api/submissions/{submission}",
                           headers={"authorization": f"Bearer {site.tokens['admin-a']}"}).json()
    assert (done["status"], done["result"], done["finished"]) == ("done", {"flower_run_id": 5}, True)


def test_a_members_submission_is_403_and_recorded(site: Site) -> None:
    answer = site.post("/api/runs", "member-n", {"scenario": QUICKSTART})
    assert answer.status_code == 403
    assert "member" in answer.json()["detail"]
    assert take(site.store, "agg", "fed") is None  # nothing queued
    [row] = site.trail(SUBMIT)
    assert (row.actor, row.detail["allowed"], row.detail["status"]) == ("member-n", False, 403)


def test_a_cookie_session_needs_the_csrf_header(site: Site) -> None:
    # Prepare: the lead's browser session (a login), its cookie only
    session = issue_session(site.store, "lead-n")
    cookies = {access.SESSION_COOKIE: session}
    # Execute: a page of another site could make the browser send the cookie, never the header
    site.client.cookies.update(cookies)
    try:
        without = site.client.post("/api/runs", json={"scenario": QUICKSTART})
        with_header = site.client.post("/api/runs", json={"scenario": QUICKSTART},
                                       headers={"x-requested-with": "quorum"})
    finally:
        site.client.cookies.clear()
    # Assert
    assert without.status_code == 403 and "x-requested-with" in without.json()["detail"]
    assert with_header.status_code == 202
    assert [r.detail["allowed"] for r in reversed(site.trail(SUBMIT))] == [False, True]


def test_an_oversized_body_is_413(site: Site) -> None:
    answer = site.post("/api/runs", "lead-n", {"scenario": "#" * (MAX_BODY + 1)})
    assert answer.status_code == 413


def test_a_body_that_is_not_json_is_415(site: Site) -> None:
    answer = site.client.post("/api/runs", content=QUICKSTART.encode(),
                              headers={"authorization": f"Bearer {site.tokens['lead-n']}",
                                       "content-type": "application/toml"})
    assert answer.status_code == 415


@pytest.mark.parametrize(("scenario", "key"), [
    ({"name": "x", "rounds": "many"}, "rounds"),
    (QUICKSTART.replace('partition = "dirichlet"', 'partition = "sideways"'), "partition"),
    ('name = "x"\n[data]\nbogus_key = 1\n', "bogus_key"),
    ({"name": "x", "task": {"entry": "mytask:Task", "path": "/etc"}}, "path"),
], ids=["wrong-type", "bad-choice", "unknown-key", "task-path-on-the-host"])
def test_a_bad_scenario_is_422_naming_the_key(site: Site, scenario: Any, key: str) -> None:
    answer = site.post("/api/runs", "lead-n", {"scenario": scenario})
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert key in detail and "\n" not in detail
    assert take(site.store, "agg", "fed") is None
    assert site.trail(SUBMIT)[0].detail["status"] == 422


def test_a_lead_stops_and_resumes_only_its_own_runs(site: Site) -> None:
    # Execute
    own = site.post(f"/api/runs/{site.run_id}/stop", "lead-n")
    others = site.post(f"/api/runs/{site.run_id}/stop", "lead-s")
    admin = site.post(f"/api/runs/{site.run_id}/resume", "admin-a")
    member = site.post(f"/api/runs/{site.run_id}/resume", "member-n")
    missing = site.post("/api/runs/no-such-run/stop", "lead-n")
    # Assert
    assert (own.status_code, others.status_code, admin.status_code, member.status_code, missing.status_code) == (
        202, 403, 202, 403, 404)
    stop = get(site.store, own.json()["submission"])
    assert stop is not None and (stop.kind, stop.run_id, stop.federation) == ("stop", site.run_id, "fed")
    assert [(r.actor, r.detail["allowed"]) for r in reversed(site.trail(STOP))] == [
        ("lead-n", True), ("lead-s", False), ("lead-n", False)]
    assert [(r.actor, r.detail["allowed"]) for r in reversed(site.trail(RESUME))] == [
        ("admin-a", True), ("member-n", False)]


def test_writes_past_the_burst_are_429(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    # a fresh guard with the real burst: the site fixture raised it for the other tests
    monkeypatch.setattr(access, "WRITE_BURST", 3)
    app = create_app(str(site.store.url), token=SHARED_TOKEN)
    with TestClient(app) as client:
        answers = [client.post("/api/runs", json={"scenario": 1},
                               headers={"authorization": f"Bearer {site.tokens['lead-n']}"}).status_code
                   for _ in range(4)]
    assert answers == [422, 422, 422, 429]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=50),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                  max_size=4), max_leaves=20)
BODIES = st.one_of(
    st.binary(max_size=300),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["scenario", "federation", "x"]), JSON, max_size=3).map(
        lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"scenario": st.text(max_size=400)}).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"scenario": st.dictionaries(
        st.sampled_from(["name", "rounds", "seed", "data", "federation", "task", "strategy", "dp"]), JSON)}).map(
        lambda v: json.dumps(v).encode()),
    st.integers(min_value=MAX_BODY - 20, max_value=MAX_BODY + 20).map(
        lambda n: json.dumps({"scenario": "x" * n}).encode()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=BODIES, path=st.sampled_from(["/api/runs", "/api/runs/{run}/stop", "/api/runs/{run}/resume"]),
       content_type=st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", ""]))
def test_no_body_makes_a_write_route_answer_5xx(site: Site, body: bytes, path: str, content_type: str) -> None:
    answer = site.client.post(path.replace("{run}", site.run_id), content=body,
                              headers={"authorization": f"Bearer {site.tokens['lead-n']}",
                                       "content-type": content_type})
    assert answer.status_code < 500, (answer.status_code, answer.text[:300])


class _Clock:
    """``quorum submit``'s clock in the test: each poll's sleep lets the "aggregator" take a step instead."""

    def __init__(self, step: Any) -> None:
        self.step, self.now = step, 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.step()


def _cli(site: Site, monkeypatch: pytest.MonkeyPatch, *args: str, step: Any = None) -> Any:
    """Run ``quorum submit`` against the in-process app (its HTTP client is the app's test client)."""
    def client(base_url: str, headers: dict[str, str], **_tls: Any) -> TestClient:
        return TestClient(site.client.app, base_url=base_url, headers=headers)

    monkeypatch.setattr(submit_cli.httpx, "Client", client)
    monkeypatch.setattr(submit_cli, "time", _Clock(step or (lambda: None)))
    return CliRunner().invoke(cli_app, ["submit", str(REPO / "scenarios" / "quickstart.toml"),
                                        "--to", "https://aggregator.example:8443", *args])


def test_quorum_submit_as_a_lead_waits_for_the_run_and_a_members_is_refused(
        site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the "aggregator" takes the submission, opens its run, and the run finishes, one poll at a time
    def aggregator() -> None:
        taken = take(site.store, "agg", "fed")
        if taken is not None:
            run_id = site.store.create_run(name="quickstart", scenario={"name": "q"}, seed=0, strategy="fedavg",
                                           rounds=1, engine="deployment", info={"submitted_by": "lead-n"})
            finish(site.store, taken.id, True, flower_run_id=3)
            attach_run(site.store, taken.id, run_id)
            site.store.set_status(run_id, "finished")

    # Execute
    lead = _cli(site, monkeypatch, "--token", site.tokens["lead-n"], "--wait", step=aggregator)
    monkeypatch.setenv("QUORUM_TOKEN", site.tokens["member-n"])
    member = _cli(site, monkeypatch)
    # Assert: exit codes, what each says, the token never echoed; both in the trail
    assert lead.exit_code == 0, lead.output
    assert "queued" in lead.output and "finished" in lead.output and site.tokens["lead-n"] not in lead.output
    assert member.exit_code == 2, member.output
    assert "403" in member.output and "member" in member.output and site.tokens["member-n"] not in member.output
    assert [(r.actor, r.detail["allowed"]) for r in reversed(site.trail(SUBMIT))] == [
        ("lead-n", True), ("member-n", False)]
