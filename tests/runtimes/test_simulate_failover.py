"""``quorum simulate --resume-on-failure`` (issue 35, item 4): two processes, one PostgreSQL store, one killed.

Both are started with the same scenario; one drives the run, the other waits
on the scenario's advisory lock. The driver is SIGKILLed mid-run (its whole
process group); the standby takes the run over from its last committed round
and ends it with the model an uninterrupted run of the same scenario gives.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from runstore.store import RunStore
from runtimes.simulation import simulate
from runtimes.standby import KEY_INFO, failover_key
from scenarios.schema import load_scenario
from tests.conftest import REPO, wait_for
from tests.postgres_server import postgres_server

pytestmark = pytest.mark.e2e  # a PostgreSQL server and two quorum processes

SCENARIO = """
name = "failover-sim"
seed = 11
rounds = 40
[data]
dataset = "digits"
[model]
name = "logreg"
[federation]
clients = 4
min_clients = 2
[training]
lr = 0.1
"""


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


def _start(scenario: Path, db: str, log: Path) -> subprocess.Popen[str]:
    with log.open("w") as err:
        return subprocess.Popen([sys.executable, "-m", "quorum", "simulate", str(scenario), "--db", db,
                                 "--resume-on-failure", "--json", "--workers", "1"], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_standby_takes_over_a_killed_drivers_run_and_ends_it_as_an_uninterrupted_run(
        pg_url: str, tmp_path: Path) -> None:
    # Prepare: the uninterrupted run (one worker, this process), then two processes for the same scenario
    scenario = tmp_path / "failover-sim.toml"
    scenario.write_text(SCENARIO)
    spec = load_scenario(scenario)
    reference = simulate(spec, db_url=f"sqlite:///{tmp_path / 'ref.db'}", workers=1)
    with RunStore(f"sqlite:///{tmp_path / 'ref.db'}") as ref_store:
        expected = ref_store.load_state(reference.run_id).params  # type: ignore[union-attr]
    procs = {name: _start(scenario, pg_url, tmp_path / f"{name}.log") for name in ("a", "b")}
    store = RunStore(pg_url)
    try:
        standby = wait_for(lambda: next((n for n in procs if "standby:" in (tmp_path / f"{n}.log").read_text()),
                                        None), 120, lambda: _logs(tmp_path), poll_s=0.1)
        driver = "b" if standby == "a" else "a"
        key = failover_key(spec)

        def driven() -> str | None:
            runs = [r for r in store.list_runs() if (r.info or {}).get(KEY_INFO) == key and r.rounds_done >= 3]
            return runs[0].id if runs else None

        run_id = wait_for(driven, 120, lambda: f"the driver's third round\n{_logs(tmp_path)}", poll_s=0.05)

        # Execute: the driver dies (SIGKILL to its whole process group), mid-run
        os.killpg(procs[driver].pid, signal.SIGKILL)
        procs[driver].wait(timeout=30)
        killed_after = store.get_run(run_id).rounds_done
        out, _ = procs[standby].communicate(timeout=240)

        # Assert: the standby ended the same run, every round once, with the uninterrupted model
        assert 3 <= killed_after < 40, "the run ended before the kill: make it longer"
        summary = json.loads(out.strip().splitlines()[-1])
        assert procs[standby].returncode == 0, (out, _logs(tmp_path))
        assert (summary["run_id"], summary["status"], summary["rounds"]) == (run_id, "finished", 40)
        assert [r.round for r in store.rounds(run_id)] == list(range(1, 41))
        events = [e.message for e in store.events(run_id)]
        assert any(m.startswith("failover: ") and f"took over after round {killed_after}" in m for m in events)
        state = store.load_state(run_id)
        assert state is not None
        np.testing.assert_allclose(state.params, expected, rtol=0, atol=1e-6)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()
        store.close()


def test_resume_on_failure_needs_a_shared_postgresql_store(tmp_path: Path) -> None:
    from quorum.cli import app

    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO)
    out = CliRunner().invoke(app, ["simulate", str(scenario), "--db", f"sqlite:///{tmp_path / 'r.db'}",
                                   "--resume-on-failure"])
    assert out.exit_code == 2, out.output
    assert "--resume-on-failure needs a PostgreSQL run store" in out.stderr and "sqlite" in out.stderr


def _logs(folder: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(folder.glob("*.log")))


def test_the_failover_key_is_the_scenarios_not_where_it_was_read_from(tmp_path: Path) -> None:
    # Prepare: one scenario with a task of its own, as two hosts (two folders) read it
    from scenarios.schema import loads_scenario

    text = 'name = "k"\nrounds = 2\n[task]\nentry = "task:MyTask"\npath = "."\n'
    here, there = tmp_path / "a", tmp_path / "b" / "c"
    for folder in (here, there):
        folder.mkdir(parents=True)
        (folder / "s.toml").write_text(text)

    # Execute
    keys = {failover_key(loads_scenario(text, str(folder / "s.toml"))) for folder in (here, there)}

    # Assert: one group; other rounds are another group
    assert len(keys) == 1
    assert failover_key(loads_scenario(text.replace("rounds = 2", "rounds = 3"), str(here / "s.toml"))) not in keys
