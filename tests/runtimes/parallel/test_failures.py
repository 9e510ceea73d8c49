"""A worker that dies or hangs fails the job with a clear error, within the timeout.

The jobs run long scenarios; a worker is killed (SIGKILL) or frozen (SIGSTOP)
by its pid once round 1 is committed. With ``--max-restarts 1`` the worker
group is restarted instead and the job resumes from the last committed round,
ending with the same model as an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from parallel_support import reference_sync, wait_for

from runstore.store import RunStore
from scenarios.schema import load_scenario

pytestmark = [pytest.mark.e2e, pytest.mark.heavy]  # real processes (docs/testing.md)

STARTUP = 90  # seconds for the launcher and both workers to import, load data and commit round 1


def _pids(pid_dir: Path) -> dict[int, int]:
    files = sorted(pid_dir.glob("rank*.pid"))
    return {int(f.stem[4:]): int(f.read_text()) for f in files if f.read_text().strip()}


def _first_round(tmp_path: Path) -> object:
    return list((tmp_path / "runs" / "checkpoints").glob("*/round-00001.safetensors"))


def _start(start_job, path, db_url, pid_dir, *extra):
    job = start_job([str(path), "--nproc", "2", "--db", db_url, "--pid-dir", str(pid_dir), *extra])
    pids = wait_for(lambda: len(_pids(pid_dir)) == 2 and _pids(pid_dir), STARTUP, "two worker pid files")
    wait_for(lambda: _first_round(db_url_path(db_url)), STARTUP, "round 1 to be committed")
    return job, pids


def db_url_path(db_url: str) -> Path:
    return Path(db_url.removeprefix("sqlite:///")).parent.parent


def test_killed_worker_fails_the_job_with_a_clear_error(start_job, scenario_file, db_url, tmp_path):
    path = scenario_file(clients=2, rounds=2000, federated="false")
    job, pids = _start(start_job, path, db_url, tmp_path / "pids", "--timeout", "30")
    # Execute
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    rc, _, err = job.wait(timeout=60)
    # Assert: fails fast (a dead peer is noticed at once, long before the 30 s timeout) and says who died.
    assert time.monotonic() - killed < 25
    assert rc == 2
    assert f"rank 1 (pid {pids[1]}) was killed by SIGKILL" in err
    run = RunStore(db_url).list_runs()[0]
    assert run.status == "failed" and f"rank 1 (pid {pids[1]}) was killed by SIGKILL" in run.error


def test_hung_worker_times_out_instead_of_hanging(start_job, scenario_file, db_url, tmp_path):
    path = scenario_file(clients=2, rounds=2000, federated="false")
    job, pids = _start(start_job, path, db_url, tmp_path / "pids", "--timeout", "3")
    store = RunStore(db_url)
    # Execute: rank 1 stops answering but its connections stay open.
    os.kill(pids[1], signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        run = wait_for(lambda: [r for r in store.list_runs() if r.status == "failed"], 30, "the run to fail")[0]
        noticed = time.monotonic() - frozen
    finally:
        os.kill(pids[1], signal.SIGCONT)  # lets it take torchrun's SIGTERM now, not after a 30 s grace
    rc, _, err = job.wait(timeout=60)
    # Assert: rank 0's collective gives up after the 3 s timeout and the job fails naming it.
    assert 3 <= noticed < 20
    assert "WorkerLost: rank 0: all_reduce failed at round" in run.error
    assert rc == 2
    assert f"rank 0 (pid {pids[0]}) exited with code 1: WorkerLost: rank 0:" in err
    assert "collective timeout 3 s" in err


def test_elastic_restart_resumes_from_the_last_committed_round(start_job, scenario_file, db_url, tmp_path):
    # Prepare: uneven shards and momentum, so a resume that lost any state would show in the params.
    path = scenario_file(clients=3, rounds=25, momentum=0.5, federated="false")
    job, pids = _start(start_job, path, db_url, tmp_path / "pids", "--max-restarts", "1")
    # Execute
    os.kill(pids[1], signal.SIGKILL)
    rc, _, err = job.wait(timeout=120)
    # Assert
    assert rc == 0, err
    store = RunStore(db_url)
    run = store.list_runs()[0]
    assert (run.status, run.rounds_done) == ("finished", 25)
    assert any("resumed after round" in e.message for e in store.events(run.id))
    expected = reference_sync(load_scenario(path), world=2)
    np.testing.assert_allclose(store.load_state(run.id).params, expected, rtol=0, atol=5e-5)
