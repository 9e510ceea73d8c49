"""Kill a run's process after round k: it reads interrupted once its lease expires; resume it, and get
exactly the uninterrupted model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from runstore.lease import LEASE_ENV
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.schema import load_scenario
from tests.conftest import REPO, wait_for

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

SCENARIO = """
name = "resume-test"
seed = 11
rounds = 8
[data]
dataset = "digits"
partition = "dirichlet"
alpha = 0.5
[model]
name = "mlp"
[federation]
clients = 6
fraction = 0.5
min_clients = 1
[training]
local_epochs = 2
batch_size = 16
lr = 0.05
[strategy]
name = "fedadam"
server_lr = 0.01
"""


def quorum(*args: str) -> list[str]:
    return [sys.executable, "-m", "quorum", *args]


def wait_for_rounds(store: RunStore, at_least: int, proc: subprocess.Popen, timeout: float = 120) -> str:
    def reached() -> str | None:
        runs = store.list_runs()
        if runs and runs[0].rounds_done >= at_least:
            return runs[0].id
        assert proc.poll() is None, "the run ended before it could be killed"
        return None

    return wait_for(reached, timeout, f"a run to reach round {at_least}", poll_s=0.02)


#: The killed process's lease, in seconds: short, so the run reads interrupted soon after the kill.
LEASE_S = 2.0


def test_killed_run_reads_interrupted_and_resumes_to_the_same_model(tmp_path: Path) -> None:
    # Prepare: a scenario file, and the uninterrupted reference in its own store.
    path = tmp_path / "resume-test.toml"
    path.write_text(SCENARIO)
    reference_db = f"sqlite:///{tmp_path / 'reference.db'}"
    reference = simulate(load_scenario(path), db_url=reference_db)
    expected = RunStore(reference_db).load_state(reference.run_id)

    # Execute: run in a real process (with a short lease), SIGKILL it once round 2 is committed, wait for
    # its lease to expire, resume (`quorum resume`, in this process: what is under test is the store the
    # killed process left, not a second start-up).
    db = f"sqlite:///{tmp_path / 'killed.db'}"
    store = RunStore(db)
    proc = subprocess.Popen(quorum("simulate", str(path), "--db", db, "--json"), cwd=REPO,
                            env={**os.environ, LEASE_ENV: str(LEASE_S)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run_id = wait_for_rounds(store, 2, proc)
        assert store.get_run(run_id).status == "running"  # its lease renewed
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    killed_at = store.get_run(run_id).rounds_done
    assert 2 <= killed_at < 8
    from quorum.cli import app

    dead = wait_for(lambda: (run := store.get_run(run_id)).status == "interrupted" and run, 3 * LEASE_S,
                    "the killed run to read interrupted")
    assert dead.rounds_done == killed_at and dead.heartbeat_at is not None
    listed = CliRunner().invoke(app, ["runs", "--db", db, "--status", "interrupted"], env={"COLUMNS": "200"})
    assert run_id in listed.stdout and "interrupted (last seen" in listed.stdout
    out = CliRunner().invoke(app, ["resume", run_id, "--db", db, "--json"])
    assert out.exit_code == 0, (out.stderr, out.exception)

    # Assert: all rounds, each exactly once, and bit-identical model and optimiser state.
    summary = json.loads(out.stdout)
    assert summary["status"] == "finished" and summary["rounds"] == 8
    assert [r.round for r in store.rounds(run_id)] == list(range(1, 9))
    resumed = store.load_state(run_id)
    np.testing.assert_array_equal(resumed.params, expected.params)
    for name in ("m", "v"):
        np.testing.assert_array_equal(resumed.slots[name], expected.slots[name])
    assert any("resumed after round" in e.message for e in store.events(run_id))
