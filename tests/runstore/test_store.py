"""The run store: rounds commit atomically with their checkpoint; state round-trips."""

from pathlib import Path

import numpy as np
import pytest

from core.errors import RunNotFound, StoreError
from core.records import ClientRecord, RoundRecord
from core.strategy import ServerState
from runstore.store import RunStore, read_checkpoint


def make_run(store: RunStore) -> str:
    return store.create_run(name="t", scenario={"name": "t"}, seed=1, strategy="fedavg", rounds=3)


def record(round_: int) -> RoundRecord:
    clients = [ClientRecord("1", "ok", num_examples=10, train_loss=0.5),
               ClientRecord("2", "dropped", stage="train", reason="no reply"),
               ClientRecord("3", "rejected", reason="update holds NaN or Inf values")]
    return RoundRecord(round=round_, started_at=0.0, duration_s=1.0, sampled=3, clients=clients,
                       server_accuracy=0.9, epsilon=1.5)


def test_round_and_state_round_trip(db_url: str) -> None:
    store = RunStore(db_url)
    run_id = make_run(store)
    state = ServerState(params=np.arange(4, dtype=np.float32), slots={"m": np.ones(4, np.float32)},
                        round=1, wrapper_state={"dp": {"history": [[0.1, 1.0, 1]]}})
    store.commit_round(run_id, record(1), state)
    loaded = store.load_state(run_id)
    np.testing.assert_array_equal(loaded.params, state.params)
    np.testing.assert_array_equal(loaded.slots["m"], state.slots["m"])
    assert loaded.round == 1 and loaded.wrapper_state == {"dp": {"history": [[0.1, 1.0, 1]]}}
    (row,) = store.rounds(run_id)
    assert (row.sampled, row.answered, row.dropped, row.rejected, row.epsilon) == (3, 1, 1, 1, 1.5)
    assert [c.outcome for c in store.client_results(run_id, 1)] == ["ok", "dropped", "rejected"]
    assert store.get_run(run_id).rounds_done == 1


def test_a_round_cannot_be_committed_twice(db_url: str) -> None:
    store = RunStore(db_url)
    run_id = make_run(store)
    state = ServerState(params=np.zeros(2, np.float32), round=1)
    store.commit_round(run_id, record(1), state)
    with pytest.raises(StoreError, match="already has round 1"):
        store.commit_round(run_id, record(1), state)
    assert len(store.rounds(run_id)) == 1 and len(store.client_results(run_id)) == 3


def test_unknown_run_and_unique_prefix(db_url: str) -> None:
    store = RunStore(db_url)
    run_id = make_run(store)
    assert store.get_run(run_id[-6:]).id == run_id
    with pytest.raises(RunNotFound, match="no run 'zzz'"):
        store.get_run("zzz")


def test_corrupt_checkpoint_is_a_store_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(StoreError, match="cannot read checkpoint"):
        read_checkpoint(bad)


def test_sqlite_store_uses_wal(db_url: str) -> None:
    store = RunStore(db_url)
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_a_store_written_before_bytes_out_gets_the_column_on_open(tmp_path) -> None:
    # Prepare: the client table as an older Quorum wrote it, with one row
    import sqlite3

    path = tmp_path / "old.db"
    RunStore(f"sqlite:///{path}")  # today's schema, then the column taken away again
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE alembic_version")  # written before the store had migrations
        db.execute("ALTER TABLE client_results DROP COLUMN bytes_out")
        db.execute("INSERT INTO runs (id, name, scenario, seed, status, engine, strategy, rounds_total, rounds_done, "
                   "num_params, started_at, updated_at, info) VALUES ('r1', 'old', '{}', 0, 'finished', 'inprocess', "
                   "'fedavg', 1, 1, 0, 0, 0, '{}')")
        db.execute("INSERT INTO client_results (run_id, round, client, outcome, num_examples, bytes_in, metrics, "
                   "finished_at) VALUES ('r1', 1, '7', 'ok', 5, 123, '{}', 0)")
    # Execute
    store = RunStore(f"sqlite:///{path}")
    # Assert: the old row reads back, with no download recorded
    (row,) = store.client_results("r1", 1)
    assert (row.client, row.bytes_in, row.bytes_out) == ("7", 123, 0)


def test_a_store_written_before_headlines_reads_its_accuracy_as_the_headline(tmp_path) -> None:
    # Prepare: two rounds as an older Quorum wrote them (no headline column; server accuracy in one, federated
    # in the other), in today's schema with the column taken away again
    import sqlite3

    path = tmp_path / "old.db"
    RunStore(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE alembic_version")  # written before the store had migrations
        db.execute("ALTER TABLE rounds DROP COLUMN headline")
        db.execute("INSERT INTO runs (id, name, scenario, seed, status, engine, strategy, rounds_total, rounds_done, "
                   "num_params, started_at, updated_at, info) VALUES ('r1', 'old', '{}', 0, 'finished', 'inprocess', "
                   "'fedavg', 2, 2, 0, 0, 0, '{}')")
        for n, server, fed in ((1, 0.75, None), (2, None, 0.5)):
            db.execute("INSERT INTO rounds (run_id, round, started_at, duration_s, sampled, answered, dropped, "
                       "rejected, failed, server_accuracy, fed_accuracy, bytes_in, bytes_out, metrics, checkpoint) "
                       "VALUES ('r1', ?, 0, 1, 1, 1, 0, 0, 0, ?, ?, 0, 0, '{}', '')", (n, server, fed))

    # Execute
    store = RunStore(f"sqlite:///{path}")

    # Assert: the column is there, holding each round's accuracy (the server's, else the federated one)
    assert [r.headline for r in store.rounds("r1")] == [0.75, 0.5]


def test_a_round_stores_the_value_of_the_runs_own_headline_metric(db_url: str) -> None:
    # Prepare: a run judged by mae (lower is better), whose round has an accuracy too
    store = RunStore(db_url)
    run_id = store.create_run(name="t", scenario={}, seed=1, strategy="fedavg", rounds=1,
                              info={"headline": {"name": "mae", "direction": "down"}})
    round_ = RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=1, clients=[], server_accuracy=0.9,
                         fed_accuracy=0.8, metrics={"server-mae": 12.5, "fed-mae": 14.0, "server-epsilon": 3.0})

    # Execute
    store.commit_round(run_id, round_, ServerState(params=np.zeros(2, np.float32), round=1))

    # Assert: the server's mae, not an accuracy; DP's server-epsilon is no task score
    (row,) = store.rounds(run_id)
    assert row.headline == 12.5
