"""The run store on a real PostgreSQL (issue 35's shared store), not SQLite standing in for it.

A simulated run writes its rounds and its checkpoints into the server's database
(the default for a server store); a second store on the same URL, as another
host would open it (no folder, no setting, nothing but the URL), reads the run,
the model bit for bit as the same scenario gives on SQLite, and a dashboard on
that URL serves the checkpoint. Two drivers of one run: a take-over in flight
is waited for, and fences the old driver out, on the server's own row locks.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select, text, update

from core.records import RoundRecord
from core.strategy import ServerState
from dashboard.app import create_app
from runstore.checkpoints import CheckpointChunk, decode_state
from runstore.schema import HEAD, revision
from runstore.store import CHECKPOINTS_ENV, LeaseLost, Run, RunStore
from runstore.takeover import TakenRunStore
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario, wait_for
from tests.postgres_server import postgres_server

with warnings.catch_warnings():  # starlette's import-time deprecations, not ours (tests/dashboard/conftest.py)
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.e2e  # a PostgreSQL server (docs/testing.md)


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


def test_a_run_on_postgresql_keeps_rounds_and_checkpoints_in_the_database_for_any_reader(
        pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the reference, the same scenario on a SQLite file (one worker: the run is deterministic)
    monkeypatch.delenv(CHECKPOINTS_ENV, raising=False)
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)  # where a checkpoint folder would appear, were one written for the PostgreSQL run
    scenario = tiny_scenario()
    local_url = f"sqlite:///{tmp_path / 'local.db'}"
    local = simulate(scenario, db_url=local_url, workers=1)
    with RunStore(local_url) as reference:
        expected = reference.load_state(local.run_id)
    assert expected is not None

    # Execute
    summary = simulate(scenario, db_url=pg_url, workers=1)

    # Assert: another host's store reads the finished run and its model, which is the SQLite run's
    with RunStore(pg_url) as other:
        run = other.get_run(summary.run_id)
        assert (run.status, run.rounds_done) == ("finished", 2), run.error
        assert [r.round for r in other.rounds(run.id)] == [1, 2]
        state = other.load_state(run.id)
        assert state is not None and state.round == 2
        np.testing.assert_array_equal(state.params, expected.params)
        # the checkpoints are rows of the database, the schema is at the head
        with other.session() as s:
            chunks = s.scalar(select(func.count()).select_from(CheckpointChunk)
                              .where(CheckpointChunk.run_id == run.id))
            assert chunks is not None and chunks >= 2  # one or more per committed round
            assert revision(s.connection()) == HEAD
    assert not list(here.iterdir())  # nothing was written outside the database

    # Assert: a dashboard on the URL serves the last round's checkpoint
    with TestClient(create_app(pg_url), base_url="http://127.0.0.1") as client:
        served = client.get(f"/api/runs/{run.id}/checkpoint")
    assert served.status_code == 200, served.text
    np.testing.assert_array_equal(decode_state(served.content, "served").params, state.params)


def test_a_take_over_in_flight_is_waited_for_and_fences_the_old_driver_out(pg_url: str) -> None:
    # Prepare: the old driver holds the run; the new one's take-over is in flight (its row written, not committed)
    with TakenRunStore(pg_url) as old, TakenRunStore(pg_url) as new:
        run_id = old.create_run(name="fence", scenario={}, seed=1, strategy="fedavg", rounds=3, engine="deployment")
        old.take(run_id)
        record = RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=0, clients=[])
        outcome: list[BaseException | None] = []
        with new.session() as s, s.begin():
            s.execute(update(Run).where(Run.id == run_id).values(holder=new.holder))

            # Execute: the old driver commits round 1 meanwhile; it must wait for the take-over to end
            committing = threading.Thread(target=_commit, args=(old, run_id, record, outcome))
            committing.start()
            wait_for(lambda: _waiting_on_a_row_lock(old), 30, "the old driver's commit to wait on the run's row")
        committing.join(timeout=30)

        # Assert: the old driver saw the new holder and stopped; nothing of its round was committed
        assert not committing.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], LeaseLost), outcome
        assert old.rounds(run_id) == [] and new.get_run(run_id).rounds_done == 0
        assert new.get_run(run_id).holder == new.holder


def _commit(store: RunStore, run_id: str, record: RoundRecord, outcome: list[BaseException | None]) -> None:
    try:
        store.commit_round(run_id, record, ServerState(params=np.zeros(3, np.float32), round=1))
        outcome.append(None)
    except Exception as exc:
        outcome.append(exc)


def _waiting_on_a_row_lock(store: RunStore) -> bool:
    with store.engine.connect() as connection:
        return bool(connection.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")))
