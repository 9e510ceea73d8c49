"""Two resumes of one run, and a driver that lost its run (issue 47, item 7).

``quorum resume`` takes the run (``runstore.takeover``: one conditional
write) before it prints or writes anything: of two resumes at once, both used
to log ``resumed after round N``, the second refused only at its first
commit; now the second is refused at once, naming the run and its holder,
exit 2, and writes nothing to the run. A driver whose run another process
took used to stop on a message about a committed round; now it says it lost
the run, exits 1, and ``--json`` prints its object.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core.records import RoundRecord
from quorum.cli import app
from quorum.progress import RoundDisplay
from quorum.resume import plan_resume
from runstore.store import RunStore
from runstore.takeover import RunHeld, TakenRunStore
from runtimes.simulation import RunSummary, simulate
from tests.conftest import REPO, tiny_scenario, wait_for
from tests.quorum.test_cli_endings import TINY

TOML = TINY.format(rounds=4)  # the tiny digits federation of test_cli_endings


def interrupted_run(db: str, rounds: int) -> str:
    """A run of ``tiny_scenario`` that Ctrl-C stopped after its first round (stored ``interrupted``)."""

    def stop(record: RoundRecord) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(tiny_scenario(rounds=rounds), db_url=db, on_round=stop, workers=1)
    run = RunStore(db).list_runs()[0]
    assert (run.status, run.rounds_done) == ("interrupted", 1)
    return run.id


def resumed_lines(db: str, run_id: str) -> list[str]:
    return [e.message for e in RunStore(db).events(run_id) if e.message.startswith("resumed after")]


def test_of_two_resumes_at_once_one_drives_the_run_and_the_other_is_refused_before_writing(db_url: str) -> None:
    # Prepare: an interrupted run, and two resumes released together (each: plan, then drive, as the command)
    run_id = interrupted_run(db_url, rounds=4)
    gate, outcomes = threading.Barrier(2), list[RunHeld | RunSummary]()

    def resume() -> None:
        gate.wait(timeout=10)
        try:
            plan = plan_resume(TakenRunStore(db_url), run_id)
        except RunHeld as exc:
            outcomes.append(exc)
            return
        outcomes.append(simulate(plan.scenario, db_url=db_url, resume_id=plan.run_id, holder=plan.holder,
                                 workers=1))

    # Execute
    threads = [threading.Thread(target=resume) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    # Assert: one resume ran rounds 2..4 once each; the other was refused naming the run; one "resumed after" line
    refused = [o for o in outcomes if isinstance(o, RunHeld)]
    done = [o for o in outcomes if isinstance(o, RunSummary)]
    assert len(refused) == 1 and len(done) == 1, outcomes
    assert str(refused[0]).startswith(f"run {run_id} is being driven by ")
    assert done[0].status == "finished" and [r.round for r in RunStore(db_url).rounds(run_id)] == [1, 2, 3, 4]
    assert resumed_lines(db_url, run_id) == ["resumed after round 1"]


def test_a_resume_while_another_process_drives_the_run_is_one_line_exit_2_and_json(db_url: str) -> None:
    # Prepare: another process took the interrupted run to resume it (its lease fresh)
    run_id = interrupted_run(db_url, rounds=3)
    other = TakenRunStore(db_url)
    plan_resume(other, run_id)
    store = RunStore(db_url)
    before = (store.get_run(run_id).lease_until, len(store.events(run_id)), store.get_run(run_id).status)

    # Execute
    out = CliRunner().invoke(app, ["resume", run_id[-6:], "--db", db_url, "--json"])

    # Assert: refused at once, naming the run and its holder; nothing written to the run
    assert out.exit_code == 2, (out.stderr, out.exception)
    line = " ".join(out.stderr.split())
    assert line.startswith(f"error: run {run_id} is being driven by {other.holder} (lease until ")
    assert line.endswith("resume it when that process stopped") and out.stderr.count("\n") == 1
    assert json.loads(out.stdout) == {"run_id": run_id, "status": "refused", "error": line.removeprefix("error: "),
                                      "exit_code": 2}
    assert (store.get_run(run_id).lease_until, len(store.events(run_id)), store.get_run(run_id).status) == before
    assert store.get_run(run_id).holder == other.holder


def taken_over_after(monkeypatch: pytest.MonkeyPatch, db: str, server_round: int) -> TakenRunStore:
    """Another process takes the run (a deployment's take-over) once round ``server_round`` is committed."""
    thief, update = TakenRunStore(db), RoundDisplay.update

    def take_over(display: RoundDisplay, record: RoundRecord) -> None:
        update(display, record)
        if record.round == server_round:
            thief.take(RunStore(db).list_runs()[0].id)

    monkeypatch.setattr(RoundDisplay, "update", take_over)
    return thief


@pytest.mark.parametrize("json_out", [True, False], ids=["json", "text"])
def test_a_simulation_that_lost_its_run_says_so_exits_1_and_stops_without_writing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, json_out: bool) -> None:
    # Prepare: four rounds; another process takes the run over after round 2
    db = f"sqlite:///{tmp_path / 'r.db'}"
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TOML)
    thief = taken_over_after(monkeypatch, db, 2)

    # Execute
    out = CliRunner().invoke(app, ["simulate", str(scenario), "--db", db, "--workers", "1",
                                   *(["--json"] if json_out else [])])

    # Assert: the lease named, not a committed round; round 3 never written; the run left to its new holder
    store = RunStore(db)
    run = store.list_runs()[0]
    said = (f"lost run {run.id} to {thief.holder}: another process took it over at round 2; this one stopped "
            "without writing")
    assert out.exit_code == 1, (out.stderr, out.exception)
    assert said in " ".join(out.stderr.split())
    if json_out:
        assert json.loads(out.stdout) == {"run_id": run.id, "status": "lost", "error": said, "exit_code": 1}
    assert (run.status, run.holder, run.error, [r.round for r in store.rounds(run.id)]) == (
        "running", thief.holder, None, [1, 2])


def test_a_resume_that_lost_its_run_says_so_in_json(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: an interrupted run of five rounds; another process takes it over after the resume's round 3
    run_id = interrupted_run(db_url, rounds=5)
    thief = taken_over_after(monkeypatch, db_url, 3)

    # Execute
    out = CliRunner().invoke(app, ["resume", run_id, "--db", db_url, "--json", "--workers", "1"])

    # Assert
    assert out.exit_code == 1, (out.stderr, out.exception)
    assert json.loads(out.stdout) == {
        "run_id": run_id, "status": "lost", "exit_code": 1,
        "error": f"lost run {run_id} to {thief.holder}: another process took it over at round 3; this one stopped "
                 "without writing"}
    store = RunStore(db_url)
    assert [r.round for r in store.rounds(run_id)] == [1, 2, 3] and resumed_lines(db_url, run_id) == [
        "resumed after round 1"]


def quorum(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "quorum", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.e2e  # two `quorum resume` processes
def test_two_resume_processes_at_once_one_is_refused_before_any_resumed_line(db_url: str) -> None:
    # Prepare: an interrupted run long enough that the first resume still drives it when the second starts
    run_id = interrupted_run(db_url, rounds=400)

    # Execute: both at once; once one has ended, Ctrl-C the other
    procs = [quorum("resume", run_id, "--db", db_url, "--json", "--workers", "1") for _ in range(2)]
    try:
        ended = wait_for(lambda: [p for p in procs if p.poll() is not None], 180, "one resume to end")
        driver = next(p for p in procs if p not in ended)
        wait_for(lambda: RunStore(db_url).get_run(run_id).rounds_done >= 2, 120, "the other to drive the run")
        os.killpg(driver.pid, signal.SIGINT)
        outputs: list[Any] = [p.communicate(timeout=120) for p in (ended[0], driver)]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)

    # Assert: the refused one said so on one line and in JSON, and wrote nothing; one "resumed after" line
    refused, driven = (json.loads(out) for out, _ in outputs)
    assert ended[0].returncode == 2 and refused["status"] == "refused", outputs[0]
    assert refused["error"].startswith(f"run {run_id} is being driven by ") and refused["run_id"] == run_id
    assert (driver.returncode, driven["status"], driven["exit_code"]) == (1, "interrupted", 1), outputs[1]
    assert resumed_lines(db_url, run_id) == ["resumed after round 1"]
    assert RunStore(db_url).get_run(run_id).status == "interrupted"
