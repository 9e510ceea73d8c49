"""The run store on a real PostgreSQL (issue 35's shared store), not SQLite standing in for it.

A simulated run writes its rounds and its checkpoints into the server's database
(the default for a server store); a second store on the same URL, as another
host would open it (no folder, no setting, nothing but the URL), reads the run,
the model bit for bit as the same scenario gives on SQLite, and a dashboard on
that URL serves the checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

from dashboard.app import create_app
from runstore.checkpoints import CheckpointChunk, decode_state
from runstore.schema import HEAD, revision
from runstore.store import CHECKPOINTS_ENV, RunStore
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario
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
