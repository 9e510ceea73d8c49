"""The run store's schema under alembic: revisions, upgrades of older stores, and the lock that makes them once.

``data/store-b1d2b18.db`` was written by main at b1d2b18, the last Quorum
before migrations (a two-round ``quorum simulate`` of a logistic regression on
digits: run ``20261203-154333-94d047``, server accuracy 0.7604 then 0.8217).
"""

from __future__ import annotations

import shutil
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine

from core.errors import StoreError
from core.records import RoundRecord
from core.strategy import ServerState
from runstore.schema import HEAD, REVISIONS, alembic_config, make_engine, revision, upgrade
from runstore.store import Base, RunStore

WRITTEN_BY_B1D2B18 = Path(__file__).parent / "data" / "store-b1d2b18.db"
OLD_RUN = "20261203-154333-94d047"


def _differences(url: str) -> list:
    """What alembic's autogenerate finds between the store at ``url`` and the models (nothing, if they agree)."""
    with make_engine(url).connect() as connection:
        return compare_metadata(MigrationContext.configure(connection), Base.metadata)


def _revision(url: str) -> str | None:
    with make_engine(url).connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def test_the_listed_revisions_are_alembics_own_chain() -> None:
    script = ScriptDirectory.from_config(alembic_config())
    chain = [s.revision for s in reversed(list(script.walk_revisions()))]
    assert tuple(chain) == REVISIONS
    assert script.get_current_head() == HEAD


def test_the_revisions_build_exactly_the_models_schema(tmp_path: Path) -> None:
    # Prepare: one store upgraded revision by revision by alembic itself, one created by the store (the models
    # and a stamp)
    migrated, created = f"sqlite:///{tmp_path / 'migrated.db'}", f"sqlite:///{tmp_path / 'created.db'}"
    engine = make_engine(migrated)
    with engine.begin() as connection:
        command.upgrade(alembic_config(connection), "head")
    RunStore(created)

    # Assert: both are at the head, and autogenerate finds nothing to change in either
    assert _revision(migrated) == _revision(created) == HEAD
    assert _differences(migrated) == []
    assert _differences(created) == []


def test_a_store_written_by_the_last_quorum_before_migrations_upgrades_on_open(tmp_path: Path) -> None:
    # Prepare: a copy of the store main wrote at b1d2b18 (no alembic_version table)
    path = tmp_path / "old.db"
    shutil.copy(WRITTEN_BY_B1D2B18, path)
    url = f"sqlite:///{path}"
    assert _revision(url) is None

    # Execute
    store = RunStore(url, checkpoint_dir=tmp_path / "checkpoints")

    # Assert: stamped and at the head, the schema the models', its run as it was written
    assert _revision(url) == HEAD and _differences(url) == []
    run = store.get_run(OLD_RUN)
    assert (run.name, run.status, run.rounds_done, run.strategy) == ("store-before-migrations", "finished", 2,
                                                                     "fedavg")
    rounds = store.rounds(OLD_RUN)
    assert [round(r.server_accuracy, 4) for r in rounds] == [0.7604, 0.8217]
    assert [r.headline for r in rounds] == [r.server_accuracy for r in rounds]
    assert len(store.client_results(OLD_RUN, 1)) == len(store.client_results(OLD_RUN, 2)) == 2
    # and it takes new runs
    new = store.create_run(name="after", scenario={}, seed=1, strategy="fedavg", rounds=1)
    store.commit_round(new, RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=0, clients=[],
                                        server_accuracy=0.5), ServerState(params=np.zeros(2, np.float32), round=1))
    assert [r.headline for r in store.rounds(new)] == [0.5]


def test_a_store_of_the_first_schema_gets_every_later_column_and_its_headlines(tmp_path: Path) -> None:
    # Prepare: the baseline revision as alembic builds it, then as a first Quorum held it (no version table),
    # with one round scored by the server and one by the clients only
    path = tmp_path / "first.db"
    url = f"sqlite:///{path}"
    with make_engine(url).begin() as connection:
        command.upgrade(alembic_config(connection), REVISIONS[0])
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE alembic_version")
        db.execute("INSERT INTO runs (id, name, scenario, seed, status, engine, strategy, rounds_total, rounds_done, "
                   "num_params, started_at, updated_at, info) VALUES ('r1', 'first', '{}', 0, 'finished', "
                   "'inprocess', 'fedavg', 2, 2, 0, 0, 0, '{}')")
        for n, server, fed in ((1, 0.75, None), (2, None, 0.5)):
            db.execute("INSERT INTO rounds (run_id, round, started_at, duration_s, sampled, answered, dropped, "
                       "rejected, server_accuracy, fed_accuracy, bytes_in, bytes_out, metrics, checkpoint) "
                       "VALUES ('r1', ?, 0, 1, 1, 1, 0, 0, ?, ?, 0, 0, '{}', '')", (n, server, fed))
        db.execute("INSERT INTO client_results (run_id, round, client, outcome, num_examples, bytes_in, metrics, "
                   "finished_at) VALUES ('r1', 1, '7', 'ok', 5, 123, '{}', 0)")

    # Execute
    store = RunStore(url, checkpoint_dir=tmp_path / "checkpoints")

    # Assert: the later columns, with what the old rows mean: no failed clients, no download, no lease, and
    # each round's accuracy (the server's, else the federated one) as its headline
    assert _revision(url) == HEAD and _differences(url) == []
    assert [(r.failed, r.headline) for r in store.rounds("r1")] == [(0, 0.75), (0, 0.5)]
    (row,) = store.client_results("r1", 1)
    assert (row.bytes_in, row.bytes_out) == (123, 0)
    run = store.get_run("r1")
    assert (run.heartbeat_at, run.lease_until) == (None, None)


def test_stores_opened_at_once_are_migrated_once(tmp_path: Path) -> None:
    # Prepare: eight copies of the old store's opening, released together (each its own connections)
    path = tmp_path / "old.db"
    shutil.copy(WRITTEN_BY_B1D2B18, path)
    url = f"sqlite:///{path}"
    start, errors = threading.Barrier(8), []

    def open_store() -> None:
        start.wait()
        try:
            RunStore(url, checkpoint_dir=tmp_path / "checkpoints").get_run(OLD_RUN)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    # Execute
    threads = [threading.Thread(target=open_store) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    # Assert: every opening worked, and the store holds one revision, the head
    assert errors == []
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]


def test_a_store_from_a_newer_quorum_is_refused_by_its_revision(tmp_path: Path) -> None:
    path = tmp_path / "newer.db"
    RunStore(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:
        db.execute("UPDATE alembic_version SET version_num = '0099'")

    with pytest.raises(StoreError, match=rf"schema revision 0099, newer than this Quorum knows \(up to {HEAD}\)"):
        RunStore(f"sqlite:///{path}")


def test_an_old_store_that_cannot_be_written_says_so_and_is_left_as_it_was(tmp_path: Path) -> None:
    # Prepare: the old store, opened read-only (as a user without write access would)
    path = tmp_path / "old.db"
    shutil.copy(WRITTEN_BY_B1D2B18, path)
    before = path.read_bytes()
    engine = create_engine("sqlite://", creator=lambda: sqlite3.connect(f"file:{path}?mode=ro", uri=True))

    # Execute / Assert: a clear refusal, nothing changed
    with pytest.raises(StoreError, match=rf"is at schema revision none, this Quorum needs {HEAD}, and it cannot be "
                                         r"upgraded: .*readonly.*; open it once with write access"):
        upgrade(engine, Base.metadata)
    with engine.connect() as connection:
        assert revision(connection) is None
    assert path.read_bytes() == before
