"""Remote run submission against a real deployment (issue 48, "Done when"): a lead submits a run from another
process with ``quorum submit --to DASHBOARD --token ...``, a member's submission is refused, both are in the audit
trail, and a lead stops its own run through the dashboard.

A federation of its own on loopback (``tests/deploy/conftest.py``: a real ``quorum aggregator start`` with its
SuperLink behind TLS, its dashboard and a SQLite run store, three enrolled agents); the dashboard queues what it is
sent in the run store and the leading aggregator's watch loop carries it out (``deploy/submissions.py``). Every
``quorum`` command runs as a process of its own, tagged so that the federation's clean-up would find a leftover.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.loopback import TAG_ENV
from deploy.supervisor import resumable_runs
from runstore.audit import RESUME, STOP, SUBMIT
from runstore.submissions import DONE, get
from tests.conftest import REPO, wait_for
from tests.deploy.conftest import Fed, needs_nginx

pytestmark = [needs_nginx, pytest.mark.e2e, pytest.mark.heavy]

LEAD, MEMBER, ORG = "lead-n", "member-n", "north"
TOKEN_LINE = re.compile(r"^token \(shown once; valid [^)]*\): (\S+)$", re.MULTILINE)


@dataclass
class Site:
    """The federation, its dashboard's address and the two accounts' API tokens."""

    fed: Fed
    url: str
    tokens: dict[str, str]

    @property
    def db(self) -> str:
        return self.fed.lb.deploy.db_url

    def quorum(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``python -m quorum *args`` as a process of its own (tagged as the federation's), output captured."""
        env = {**os.environ, TAG_ENV: self.fed.lb.procs.tag}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        return subprocess.run([sys.executable, "-m", "quorum", *args], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=self.fed.lb.workdir, stdin=subprocess.DEVNULL, check=False)

    def client(self, who: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.tokens[who]}"},
                            timeout=30.0)

    def trail(self, action: str) -> list[dict[str, Any]]:
        """The audit trail's rows of ``action``, newest first, as ``quorum audit --json`` prints them."""
        done = self.quorum("audit", "--db", self.db, "--json", "--action", action, "--limit", "100")
        assert done.returncode == 0, done.stdout + done.stderr
        rows: list[dict[str, Any]] = json.loads(done.stdout)["rows"]
        return rows


def _add_account(site: Site, name: str, role: str) -> str:
    done = site.quorum("accounts", "add", name, "--org", ORG, "--role", role, "--db", site.db)
    assert done.returncode == 0, done.stdout + done.stderr
    found = TOKEN_LINE.search(done.stdout)
    assert found is not None, done.stdout
    return found.group(1)


@pytest.fixture(scope="module")
def site(fed: Fed) -> Iterator[Site]:
    # The dashboard the aggregator started, as its pid file names it
    pidfile = json.loads(fed.lb.deploy.state.pidfile.read_text())
    url = str(pidfile["dashboard"]).rstrip("/")
    assert url == f"http://127.0.0.1:{fed.lb.dashboard_port}", pidfile
    site = Site(fed, url, {})
    site.tokens = {LEAD: _add_account(site, LEAD, "lead"), MEMBER: _add_account(site, MEMBER, "member")}
    yield site


def _no_token_is_401(site: Site) -> bool:
    """Whether the dashboard asks for a token now (it looks for live accounts in its store every 2 s)."""
    with httpx.Client(base_url=site.url, timeout=10.0) as anonymous:
        return anonymous.get("/api/runs").status_code == 401


def _serverapps(fed: Fed) -> list[int]:
    """The federation's live ServerApp processes (one per Flower run, started by the SuperExec)."""
    found = []
    for pid in fed.lb.procs.alive():
        with contextlib.suppress(OSError):
            if b"flwr-serverapp" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def _carried_out(fed: Fed, client: httpx.Client, queued: httpx.Response) -> dict[str, Any]:
    """Wait until the aggregator carried out a queued stop or resume (its answer to ``GET /api/submissions/ID``)."""
    assert queued.status_code == 202, queued.text
    submission = int(queued.json()["submission"])

    def finished() -> dict[str, Any] | None:
        answer: dict[str, Any] = client.get(f"/api/submissions/{submission}").json()
        return answer if answer.get("finished") else None

    found: dict[str, Any] = wait_for(finished, 60.0, lambda: f"the aggregator to carry out submission "
                                     f"{submission}\n{fed.logs()}", poll_s=0.5)
    return found


def test_a_lead_submits_from_another_process_and_a_members_submission_is_refused(site: Site) -> None:
    # Prepare: a store with accounts wants a token, even on loopback
    fed = site.fed
    wait_for(lambda: _no_token_is_401(site), 15.0, "the dashboard to ask for a token once accounts exist")
    scenario = fed.scenario("remote", rounds=1)

    # Execute: the lead's submission, followed to its end; then the member's
    lead = site.quorum("submit", str(scenario), "--to", site.url, "--token", site.tokens[LEAD], "--wait",
                       "--timeout", "240", timeout_s=300)
    member = site.quorum("submit", str(scenario), "--to", site.url, "--token", site.tokens[MEMBER], timeout_s=60)

    # Assert: the lead's run ran to its end on the federation, recorded as the lead's
    said = lead.stdout + lead.stderr
    assert lead.returncode in (0, 3), f"{said}\n{fed.logs()}"
    queued = re.search(r"^submission (\d+) queued$", lead.stdout, re.MULTILINE)
    ended = re.search(r"^run (\S+) (finished|degraded)$", lead.stdout, re.MULTILINE)
    assert queued is not None and ended is not None, said
    run = fed.store.get_run(ended.group(1))
    assert (run.status, run.rounds_done) == (ended.group(2), 1), f"{run.status}: {run.error}\n{fed.logs()}"
    info = run.info or {}
    assert (info.get("submitted_by"), info.get("submitted_org")) == (LEAD, ORG), info
    assert info.get("federation") == fed.lb.deploy.aggregator.name and info.get("flower_run_id"), info
    submission = get(fed.store, int(queued.group(1)))
    assert submission is not None and (submission.status, submission.run_id) == (DONE, run.id), submission
    # the member's: refused by the dashboard with its reason, exit 2, nothing queued
    assert member.returncode == 2, member.stdout + member.stderr
    assert "403: forbidden: role 'member' may not POST /api/runs" in member.stderr, member.stderr
    assert "queued" not in member.stdout
    # both attempts in the audit trail, and the trail checks out end to end
    submits = site.trail(SUBMIT)
    allowed = [r for r in submits if r["actor"] == LEAD and r["detail"].get("allowed") is True]
    refused = [r for r in submits if r["actor"] == MEMBER and r["detail"].get("allowed") is False]
    assert [(r["org"], r["target"], r["detail"].get("submission")) for r in allowed] == [
        (ORG, "deploy-remote", submission.id)], submits
    assert [(r["org"], r["target"], r["detail"].get("status")) for r in refused] == [
        (ORG, "/api/runs", 403)], submits
    verified = site.quorum("audit", "--db", site.db, "--verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_lead_stops_its_run_through_the_dashboard_and_it_stays_stopped(site: Site) -> None:
    # Prepare: a long run submitted by the lead, running on the devices
    fed = site.fed
    scenario = fed.scenario("to-stop", rounds=40, deadline=20.0)
    queued = site.quorum("submit", str(scenario), "--to", site.url, "--token", site.tokens[LEAD], timeout_s=60)
    assert queued.returncode == 0, queued.stdout + queued.stderr
    found = re.search(r"^submission (\d+) queued$", queued.stdout, re.MULTILINE)
    assert found is not None, queued.stdout
    submission = int(found.group(1))
    with site.client(LEAD) as lead, site.client(MEMBER) as member:

        def opened() -> str | None:
            answer = lead.get(f"/api/submissions/{submission}")
            assert answer.status_code == 200, answer.text
            return answer.json().get("run_id")

        run_id = str(wait_for(opened, 120.0, lambda: f"the submitted run to open\n{fed.logs()}", poll_s=0.5))
        fed.wait_rounds(run_id, 1, timeout_s=120.0)

        # Execute: a member may not stop it; its lead does
        refused = member.post(f"/api/runs/{run_id}/stop")
        stopped = lead.post(f"/api/runs/{run_id}/stop")

        # Assert: the stop is carried out by the aggregator, and the run ends failed, "stopped by" its lead
        assert refused.status_code == 403, refused.text
        outcome = _carried_out(fed, lead, stopped)
    assert outcome["status"] == DONE and outcome["result"].get("stopped") is True, outcome
    wait_for(lambda: not _serverapps(fed), 60.0, lambda: f"the stopped run's ServerApp to exit\n{fed.logs()}",
             poll_s=0.2)
    run = fed.wait_finished(run_id, timeout_s=60.0)  # after its ServerApp ended: what it wrote last is in
    assert run.status == "failed" and run.rounds_done < run.rounds_total, (run.status, run.rounds_done, run.error)
    assert f"stopped by {LEAD}" in (run.error or ""), run.error
    # not resumed: the aggregator would resume neither on a restart nor after a failover
    assert run_id not in resumable_runs(site.db, fed.lb.deploy.aggregator.name)
    # its lead may resume it: a new Flower run goes on from its last round; stopped again, it stays stopped
    with site.client(LEAD) as lead:
        resumed = _carried_out(fed, lead, lead.post(f"/api/runs/{run_id}/resume"))
        assert resumed["status"] == DONE and resumed["result"]["flower_run_id"] != run.info["flower_run_id"], resumed
        wait_for(lambda: fed.store.get_run(run_id).rounds_done > run.rounds_done, 120.0,
                 lambda: f"the resumed run to commit a round\n{fed.logs()}", poll_s=0.2)
        again = _carried_out(fed, lead, lead.post(f"/api/runs/{run_id}/stop"))
    assert again["status"] == DONE and again["result"].get("stopped") is True, again
    assert again["result"]["flower_run_id"] == resumed["result"]["flower_run_id"], (again, resumed)
    wait_for(lambda: not _serverapps(fed), 60.0, lambda: f"the resumed run's ServerApp to exit\n{fed.logs()}",
             poll_s=0.2)
    run = fed.store.get_run(run_id)
    assert run.status == "failed" and f"stopped by {LEAD} (submission {again['id']})" in (run.error or ""), run.error
    assert run_id not in resumable_runs(site.db, fed.lb.deploy.aggregator.name)
    stops = site.trail(STOP)
    assert sorted((r["actor"], r["detail"].get("allowed")) for r in stops if run_id in r["target"]) == [
        (LEAD, True), (LEAD, True), (MEMBER, False)], stops
    assert [r["actor"] for r in site.trail(RESUME) if r["target"] == run_id] == [LEAD]
    verified = site.quorum("audit", "--db", site.db, "--verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr

