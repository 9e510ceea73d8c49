"""Runs that cannot start say so (issue 17, item 3), without a running federation.

``quorum aggregator run`` checks the online devices against the scenario
before it submits; a run whose ServerApp gives up waiting is stored as
``failed`` with the reason; ``--wait`` ends non-zero with that reason, or
when the run's ServerApp is gone without opening a run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import typer

from aggregator.serverapp import record_failed_start
from deploy import cli, readiness, status
from deploy.config import load_config
from deploy.errors import DeployError
from deploy.readiness import Fleet, await_devices, shortfall
from deploy.status import ServerAppWatch, find_stored_run
from runstore.store import RunStore
from runstore.takeover import TakenRunStore
from tests.conftest import tiny_scenario

SCENARIO = tiny_scenario(name="five", federation={"clients": 5, "min_clients": 3})


def config(tmp_path: Path, wait_s: float = 0.0, insecure: bool = False) -> Any:
    path = tmp_path / "federation.toml"
    path.write_text(f"[aggregator]\nwait_clients_s = {wait_s}\ninsecure = {str(insecure).lower()}\n"
                    'listen = "127.0.0.1"\n')
    return load_config(path)


def test_too_few_online_names_the_numbers_and_the_fix() -> None:
    why = shortfall(SCENARIO, Fleet(enrolled=5, online=("dev0", "dev1")), insecure=False)
    assert why is not None
    assert "2 of the 3 devices" in why and "federation.min_clients = 3" in why and "online: dev0, dev1" in why
    assert "start more client agents" in why


def test_too_few_enrolled_asks_to_enroll() -> None:
    why = shortfall(SCENARIO, Fleet(enrolled=2, online=("dev0", "dev1")), insecure=False)
    assert why is not None and "only 2 devices are enrolled" in why and "quorum client enroll" in why
    # an --insecure trial enrols nobody: only the online count matters
    assert shortfall(SCENARIO, Fleet(enrolled=0, online=("1", "2", "3")), insecure=True) is None


def test_enough_online_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(readiness, "fleet", lambda _c: Fleet(5, ("a", "b", "c")))
    said: list[str] = []
    assert await_devices(config(tmp_path), SCENARIO, say=said.append).online == ("a", "b", "c")
    assert said == ["3 of the 5 clients online (a, b, c): the run waits up to 0 s for the rest, then starts "
                    "with those connected"]


def test_it_waits_with_a_count_then_starts_when_devices_come(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    views = iter([Fleet(5, ("a",)), Fleet(5, ("a", "b")), Fleet(5, ("a", "b", "c", "d", "e"))])
    monkeypatch.setattr(readiness, "fleet", lambda _c: next(views))
    said: list[str] = []
    await_devices(config(tmp_path, wait_s=30), SCENARIO, say=said.append, poll_s=0.0)
    assert [m.split(";")[0] for m in said] == ["1 of 3 devices online", "2 of 3 devices online"]


def test_it_refuses_with_the_numbers_when_the_wait_ends(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(readiness, "fleet", lambda _c: Fleet(5, ("a",)))
    with pytest.raises(DeployError, match=r"1 of the 3 devices .* \(waited 0.05 s, aggregator.wait_clients_s\)"):
        await_devices(config(tmp_path, wait_s=0.05), SCENARIO, say=lambda _m: None, poll_s=0.01)


def test_a_run_that_never_started_is_stored_failed_and_wait_exits_non_zero(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path)
    store = TakenRunStore(cfg.db_url)
    run_id = record_failed_start(store, SCENARIO, 77, {"1": "dev0"}, "only 2 of the 3 clients the scenario needs "
                                 "connected within 120 s")

    run = find_stored_run(RunStore(cfg.db_url), 77)
    assert run is not None and run.id == run_id and run.status == "failed"
    assert run.error == "never started: only 2 of the 3 clients the scenario needs connected within 120 s"
    with pytest.raises(typer.Exit) as done:
        cli._follow(cfg, 77, timeout_s=10)
    assert done.value.exit_code == 1
    assert f"run {run_id} failed: never started: only 2 of the 3" in capsys.readouterr().out


@pytest.mark.e2e
def test_wait_notices_a_serverapp_that_died_without_a_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(tmp_path)
    folder = cfg.state.root / "serverapps"
    folder.mkdir(parents=True)
    app = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "flwr-serverapp"])
    threading.Thread(target=app.wait, daemon=True).start()
    pidfile = folder / f"{app.pid}.json"
    pidfile.write_text(json.dumps({"pid": app.pid, "flower_run": 5}))
    (folder / f"{os.getpid()}.json").write_text(json.dumps({"pid": os.getpid(), "flower_run": 5}))  # not one
    (cfg.state.root / "logs").mkdir()
    (cfg.state.root / "logs" / "serverapp-5.log").write_text("start\nDeployError: the scenario is bad\n")
    monkeypatch.setattr(status, "EXIT_GRACE_S", 0.0)
    watch = ServerAppWatch(cfg, 5)
    assert watch.dead() is None          # running: it may still open its run
    assert status.serverapp_pids(cfg, 5) == [app.pid]  # this test's own process is no ServerApp
    app.kill()
    pidfile.unlink()
    watch.dead()                          # gone: noted
    why = watch.dead()
    assert why is not None and "DeployError: the scenario is bad" in why and "serverapp-5.log" in why


def test_a_run_whose_serverapp_never_starts_is_called_dead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "START_GRACE_S", 0.0)
    why = ServerAppWatch(config(tmp_path), 6).dead()
    assert why is not None and "no ServerApp started" in why


def _fake_aggregator(tmp_path: Path, *argv_words: str) -> subprocess.Popen:
    """A process that looks like ``quorum aggregator start`` (or not) and exits on SIGTERM."""
    script = tmp_path / "fake.py"
    script.write_text("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
                      "print('up', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(script), *argv_words], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    proc.stdout.close()
    return proc  # not reaped by anyone while a test stops it: a zombie must count as stopped


@pytest.mark.e2e
def test_stop_ends_the_aggregator_named_by_the_pid_file(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    proc = _fake_aggregator(tmp_path, "aggregator", "start")
    try:
        cfg.state.pidfile.parent.mkdir(parents=True, exist_ok=True)
        cfg.state.pidfile.write_text(json.dumps({"pid": proc.pid}))
        assert status.stop_aggregator(cfg, timeout_s=20, poll_s=0.05) == proc.pid
        assert proc.wait(timeout=5) == 0
        with pytest.raises(DeployError, match="has exited"):
            status.stop_aggregator(cfg)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.e2e
def test_stop_refuses_a_pid_file_naming_another_program(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    with pytest.raises(DeployError, match="no aggregator running here"):
        status.stop_aggregator(cfg)
    proc = _fake_aggregator(tmp_path, "aggregator", "run", "--wait")  # a pid reused by another command
    try:
        cfg.state.pidfile.parent.mkdir(parents=True, exist_ok=True)
        cfg.state.pidfile.write_text(json.dumps({"pid": proc.pid}))
        with pytest.raises(DeployError, match="is not `quorum aggregator start`"):
            status.stop_aggregator(cfg)
        assert proc.poll() is None  # left alone
    finally:
        proc.kill()
        proc.wait()


def test_the_wait_survives_a_superlink_that_cannot_list_devices_for_a_moment(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    answers: list[object] = [Fleet(5, ("a",)), DeployError("cannot list nodes: connection refused"),
                             Fleet(5, ("a", "b", "c"))]

    def fleet(_config: object) -> Fleet:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(readiness, "fleet", fleet)
    said: list[str] = []
    assert await_devices(config(tmp_path, wait_s=30), SCENARIO, say=said.append, poll_s=0.0).online == ("a", "b", "c")
    assert any("asking again" in m for m in said)


def test_wait_prints_each_round_with_who_failed_why_and_exits_3_for_a_degraded_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a stored deployed run whose device-3 failed its round, already ended as the ServerApp ends it
    import numpy as np

    from aggregator.serverapp import final_status
    from core.records import ClientRecord, RoundRecord
    from core.strategy import ServerState

    cfg = config(tmp_path)
    store = RunStore(cfg.db_url)
    run_id = store.create_run(name="five", scenario={}, seed=1, strategy="fedavg", rounds=1, engine="deployment",
                              info={"flower_run_id": 78, "devices": {"1": "device-1", "2": "device-2",
                                                                      "3": "device-3"}})
    clients = [ClientRecord("1", "ok"), ClientRecord("2", "ok"),
               ClientRecord("3", "failed", stage="train", reason="DataError: no label column 'label'")]
    store.commit_round(run_id, RoundRecord(round=1, started_at=0.0, duration_s=2.5, sampled=3, clients=clients,
                                           fed_accuracy=0.75, metrics={"status": "ok"}),
                       ServerState(params=np.zeros(2, np.float32), round=1))
    store.set_status(run_id, *final_status(store, run_id, "finished"))

    # Execute
    with pytest.raises(typer.Exit) as done:
        cli._follow(cfg, 78, timeout_s=10)

    # Assert: the round line names the device and its error; the ending says degraded and why; exit 3
    out = capsys.readouterr().out
    assert done.value.exit_code == 3
    assert (f"run {run_id} round 1: 2/3 answered, 1 failed: device-3 DataError: no label column 'label', 2.5 s, "
            "accuracy 0.750 (on the devices)") in out
    assert f"run {run_id} degraded: device-3 failed in 1 of 1 rounds (DataError: no label column 'label')" in out


def test_until_the_run_opens_wait_says_how_many_devices_are_connected(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the fleet seen at three counts, the second one twice
    views = iter([Fleet(5, ("a",)), Fleet(5, ("a", "b")), Fleet(5, ("a", "b")), Fleet(5, ("a", "b", "c"))])
    monkeypatch.setattr(readiness, "fleet", lambda _c: next(views))
    waiting = cli.DeviceWait(config(tmp_path, wait_s=120), SCENARIO)

    # Execute: polled often, counted every WAIT_COUNT_S
    for now in (0.0, 1.0, cli.WAIT_COUNT_S, 2 * cli.WAIT_COUNT_S, 3 * cli.WAIT_COUNT_S):
        waiting.poll(now)

    # Assert: one line per new count, naming the numbers the run waits for
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(";")[0] for line in lines] == ["waiting for devices: 1 of 5 connected (a)",
                                                      "waiting for devices: 2 of 5 connected (a, b)",
                                                      "waiting for devices: 3 of 5 connected (a, b, c)"]
    assert lines[0].endswith("the run starts once 5 are, or with at least 3 after aggregator.wait_clients_s = 120 s")


def _interrupted_run(cfg: Any, flower_run: int) -> tuple[RunStore, str]:
    store = RunStore(cfg.db_url)
    run_id = store.create_run(name="five", scenario={}, seed=1, strategy="fedavg", rounds=3, engine="deployment",
                              info={"flower_run_id": flower_run})
    store.set_status(run_id, "interrupted", "the SuperLink exited; the aggregator resumes it")
    return store, run_id


def test_wait_on_an_interrupted_run_nothing_will_resume_names_why_and_the_next_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: an interrupted run, and no aggregator running here
    cfg = config(tmp_path)
    _, run_id = _interrupted_run(cfg, 78)

    # Execute
    with pytest.raises(typer.Exit) as done:
        cli._follow(cfg, 78, timeout_s=10)

    # Assert: exit 1 (interrupted), the reason, and the two ways on
    out = capsys.readouterr().out
    assert done.value.exit_code == 1
    assert f"run {run_id} interrupted after round 0 (the SuperLink exited; the aggregator resumes it)" in out
    assert "quorum aggregator start" in out and f"quorum aggregator run --resume {run_id}" in out


def test_wait_follows_a_run_the_aggregator_resumes_to_its_end(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: an aggregator up here (this process, by its pid file) that resumes runs; the run is resumed
    # under another Flower run a second later and finishes
    cfg = config(tmp_path)
    store, run_id = _interrupted_run(cfg, 79)
    cfg.state.pidfile.parent.mkdir(parents=True, exist_ok=True)
    cfg.state.pidfile.write_text(json.dumps({"pid": os.getpid(), "resume": True}))

    def resumed() -> None:
        store.update_info(run_id, flower_run_id=80)
        store.set_status(run_id, "running")
        store.set_status(run_id, "finished")

    timer = threading.Timer(1.5, resumed)
    timer.start()

    # Execute
    with pytest.raises(typer.Exit) as done:
        cli._follow(cfg, 79, timeout_s=20)
    timer.join()

    # Assert: said once that the aggregator resumes it, then followed the same run to its end
    out = capsys.readouterr().out
    assert done.value.exit_code == 0, out
    assert out.count("the aggregator resumes it from its last committed round: waiting") == 1, out
    assert f"run {run_id} finished" in out


def test_wait_takes_a_serverapp_stopped_under_its_run_for_an_interruption(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the run's ServerApp was stopped (SystemExit, stored as failed) and the aggregator here resumes
    # it: for the seconds before the supervisor marks it interrupted, --wait must not call it failed
    cfg = config(tmp_path)
    store, run_id = _interrupted_run(cfg, 81)
    store.set_status(run_id, "failed", "SystemExit: the ServerApp was stopped")
    cfg.state.pidfile.parent.mkdir(parents=True, exist_ok=True)
    cfg.state.pidfile.write_text(json.dumps({"pid": os.getpid(), "resume": True}))
    timer = threading.Timer(1.5, lambda: (store.set_status(run_id, "running"), store.set_status(run_id, "finished")))
    timer.start()

    # Execute
    with pytest.raises(typer.Exit) as done:
        cli._follow(cfg, 81, timeout_s=20)
    timer.join()

    # Assert
    out = capsys.readouterr().out
    assert done.value.exit_code == 0, out
    assert "the aggregator resumes it" in out and f"run {run_id} finished" in out and "failed" not in out
