"""The leading aggregator carries out the dashboard's queued submissions (``deploy/submissions.py``, issue #48).

The Control API is faked (``submit``, ``stop_run``): what is checked is what
the aggregator asks of it, and what it writes back to the real SQLite store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aggregator.serverapp import _submitted
from deploy import submissions, supervisor
from deploy.config import load_config
from deploy.errors import DeployError
from deploy.submit import run_config
from runstore.store import RunStore
from runstore.submissions import DONE, FAILED, PENDING, enqueue, get
from tests.conftest import tiny_scenario


def config(tmp_path: Path) -> Any:
    path = tmp_path / "federation.toml"
    path.write_text('[aggregator]\nlisten = "127.0.0.1"\nname = "fed"\n')
    return load_config(path)


class FakeControl:
    """What the aggregator asked of the SuperLink's Control API; Flower run ids 41, 42, ..."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: str | None = None) -> None:
        self.submitted: list[dict[str, Any]] = []
        self.stopped: list[int] = []
        self.fail = fail
        monkeypatch.setattr(submissions, "submit", self.submit)
        monkeypatch.setattr(submissions, "stop_run", self.stop_run)

    def submit(self, _config: Any, **kwargs: Any) -> int:
        if self.fail:
            raise DeployError(self.fail)
        self.submitted.append(kwargs)
        return 40 + len(self.submitted)

    def stop_run(self, _config: Any, flower_run_id: int) -> bool:
        self.stopped.append(flower_run_id)
        return True


def test_a_submission_is_submitted_with_its_submitter_and_marked_done(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    cfg, fake = config(tmp_path), FakeControl(monkeypatch)
    spec = tiny_scenario().to_dict()
    with RunStore(cfg.db_url) as store:
        mine = enqueue(store, "lead-n", "north", "submit", scenario=spec)
        theirs = enqueue(store, "lead-s", "south", "submit", federation="another", scenario=spec)
    # Execute
    said: list[str] = []
    assert submissions.process_pending(cfg, said.append) == [mine]
    # Assert: submitted with the scenario and who asked; done with the Flower run; another federation's left
    assert fake.submitted == [{"spec": spec, "submitter": {"account": "lead-n", "org": "north", "submission": mine}}]
    with RunStore(cfg.db_url) as store:
        done, left = get(store, mine), get(store, theirs)
    assert done is not None and (done.status, done.result) == (DONE, {"flower_run_id": 41})
    assert done.taken_by is not None and done.taken_by.startswith("fed@")
    assert left is not None and left.status == PENDING
    assert said == [f"submission {mine} (submit by lead-n): done {{'flower_run_id': 41}}"]


def test_the_run_config_carries_the_submitter_which_the_serverapp_records(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    spec = tiny_scenario().to_dict()
    submitted = run_config(cfg, spec=spec, submitter={"account": "lead-n", "org": "north", "submission": 7})
    assert json.loads(submitted["scenario-json"]) == spec
    assert (submitted["submitted-by"], submitted["submitted-org"], submitted["submission"]) == ("lead-n", "north", 7)
    assert _submitted(submitted) == {"submitted_by": "lead-n", "submitted_org": "north", "submission": 7}
    assert _submitted(run_config(cfg, spec=spec)) == {}  # `quorum aggregator run`: nobody recorded


def test_a_submission_the_control_api_refuses_is_failed_with_the_reason(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(tmp_path)
    FakeControl(monkeypatch, fail="the SuperLink refused the run: no such app\nsecond line")
    with RunStore(cfg.db_url) as store:
        queued = enqueue(store, "lead-n", "north", "submit", scenario=tiny_scenario().to_dict())
    submissions.process_pending(cfg, lambda _line: None)
    with RunStore(cfg.db_url) as store:
        failed = get(store, queued)
    assert failed is not None and (failed.status, failed.result) == (
        FAILED, {"error": "the SuperLink refused the run: no such app"})


def test_a_stop_stops_the_flower_run_and_a_resume_resubmits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a running run of Flower run 9
    cfg, fake = config(tmp_path), FakeControl(monkeypatch)
    with RunStore(cfg.db_url) as store:
        run_id = store.create_run(name="tiny", scenario=tiny_scenario().to_dict(), seed=3, strategy="fedavg",
                                  rounds=2, engine="deployment", info={"flower_run_id": 9, "federation": "fed"})
        stop = enqueue(store, "lead-n", "north", "stop", federation="fed", run_id=run_id)
        resume = enqueue(store, "lead-n", "north", "resume", federation="fed", run_id=run_id)
    # Execute
    submissions.process_pending(cfg, lambda _line: None)
    # Assert: stopped (recorded failed, "stopped by": not resumed on its own), then resumed as a new Flower run
    with RunStore(cfg.db_url) as store:
        stopped, resumed, run = get(store, stop), get(store, resume), store.get_run(run_id)
    assert fake.stopped == [9, 9]  # the stop; the resume stops the old Flower run first, as a restart does
    assert fake.submitted == [{"resume": run_id}]
    assert stopped is not None and (stopped.status, stopped.result["run_id"]) == (DONE, run_id)
    assert resumed is not None and resumed.result == {"flower_run_id": 41, "run_id": run_id}
    assert run.status == "failed" and "stopped by lead-n" in (run.error or "")
    assert (run.info or {})["flower_run_id"] == 41  # the resumed Flower run: what a stop meanwhile stops
    assert not supervisor.resumable_runs(cfg.db_url, "fed")


def test_the_watch_loop_takes_submissions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a supervisor whose watch ends once it looked for submissions
    sup = supervisor.Supervisor(config(tmp_path), say=lambda _line: None)
    calls: list[Any] = []

    def fake(cfg: Any, _say: Any, store: Any = None) -> list[int]:
        calls.append((cfg, store))
        sup.stopping.set()
        return []

    monkeypatch.setattr(supervisor, "process_pending", fake)
    monkeypatch.setattr(supervisor, "SUBMISSIONS_S", 0.0)
    # Execute
    sup.watch(poll_s=0.01)
    # Assert: asked once, with the store the loop keeps open (not a new engine a second)
    assert calls == [(sup.config, sup.submissions_store)] and sup.submissions_store is not None
    sup.submissions_store.close()
