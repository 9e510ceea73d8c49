"""A run's writer (runstore/runlog.py): holds the lease while it drives the run, commits, ends it once."""

from __future__ import annotations

import numpy as np

from core.records import RoundRecord
from core.strategy import ServerState
from runstore.runlog import RunLog
from runstore.store import RunStore


def _run(db_url: str) -> RunLog:
    store = RunStore(db_url)
    return RunLog(store, store.create_run(name="t", scenario={}, seed=1, strategy="fedavg", rounds=2))


def test_a_held_run_commits_its_rounds_and_ends_with_its_status_and_logged_error(db_url: str) -> None:
    # Prepare
    run = _run(db_url).hold()
    assert run.heartbeat is not None

    # Execute: one round, an event, then a failure
    run.commit(RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=0, clients=[], server_accuracy=0.5),
               ServerState(params=np.ones(3, np.float32), round=1))
    run.log("a note")
    run.end("failed", error="RuntimeError: boom", log_error=True)

    # Assert: the round and its checkpoint, the status with its reason, both events; the lease no longer renewed
    stored = run.store.get_run(run.run_id)
    assert (stored.status, stored.error, stored.rounds_done) == ("failed", "RuntimeError: boom", 1)
    state = run.store.load_state(run.run_id)
    assert state is not None and state.params.tolist() == [1.0, 1.0, 1.0]
    assert [(e.level, e.message) for e in run.store.events(run.run_id)] == [("info", "a note"),
                                                                            ("error", "RuntimeError: boom")]
    assert run.heartbeat is None


def test_release_stops_the_lease_and_leaves_the_status(db_url: str) -> None:
    run = _run(db_url).hold()
    run.release()
    run.release()  # twice is harmless
    assert run.heartbeat is None and run.store.get_run(run.run_id).status == "running"
