"""Checkpoints in a shared place: the database itself or an fsspec URL, read back from the reference alone."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, update

from core.errors import StoreError
from core.records import RoundRecord
from core.strategy import ServerState
from runstore import checkpoints as ck
from runstore.checkpoints import (
    CheckpointChunk,
    DatabaseCheckpoints,
    FolderCheckpoints,
    UrlCheckpoints,
    checkpoints_at,
    decode_state,
    encode_state,
)
from runstore.store import Round, RunStore


def _state(size: int, server_round: int) -> ServerState:
    rng = np.random.default_rng(server_round)
    return ServerState(params=rng.standard_normal(size).astype(np.float32),
                       slots={"m": rng.standard_normal(size).astype(np.float32)}, round=server_round,
                       wrapper_state={"dp": {"clip": 0.5, "history": [[0.1, 1.0, 2]]}})


def _record(server_round: int) -> RoundRecord:
    return RoundRecord(round=server_round, started_at=0.0, duration_s=1.0, sampled=2, clients=[])


def _run(store: RunStore) -> str:
    return store.create_run(name="ckpt", scenario={"name": "ckpt"}, seed=0, strategy="fedavg", rounds=3)


def _same(a: ServerState, b: ServerState) -> bool:
    return (np.array_equal(a.params, b.params) and a.slots.keys() == b.slots.keys()
            and all(np.array_equal(a.slots[k], b.slots[k]) for k in a.slots)
            and a.round == b.round and a.wrapper_state == b.wrapper_state)


def test_checkpoints_in_the_database_are_read_by_another_host_without_any_file(tmp_path: Path) -> None:
    # Prepare: the aggregator's store keeps its checkpoints in the database; its working folder is its own
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    writer = RunStore(url, checkpoints="db")
    run_id = _run(writer)
    states = [_state(1000, r) for r in (1, 2)]

    # Execute
    for state in states:
        writer.commit_round(run_id, _record(state.round), state)

    # Assert: no checkpoint file anywhere; the rounds name their rows
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("shared.db")] == []
    assert [r.checkpoint for r in writer.rounds(run_id)] == [f"db:{run_id}/1", f"db:{run_id}/2"]
    # another host: a store on the same URL that would write its own checkpoints to a folder reads them
    elsewhere = RunStore(url, checkpoint_dir=tmp_path / "other-host")
    loaded = elsewhere.load_state(run_id)
    assert loaded is not None and _same(loaded, states[1])
    first = elsewhere.load_state(run_id, 1)
    assert first is not None and _same(first, states[0])
    served = elsewhere.checkpoint_blob(run_id, 1)  # what the dashboard serves (tests/dashboard)
    assert served is not None and served[0] == 1 and _same(decode_state(served[1], "served"), states[0])


def test_a_large_checkpoint_is_split_into_chunks_and_joined_in_order(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ck, "CHUNK_BYTES", 1000)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints="db")
    run_id = _run(store)
    state = _state(2500, 1)  # about 20 kB: 20-odd chunks
    store.commit_round(run_id, _record(1), state)
    with store.session() as s:
        chunks = s.scalar(select(func.count()).select_from(CheckpointChunk).where(CheckpointChunk.run_id == run_id))
    assert chunks == -(-len(encode_state(state, "x")) // 1000) > 15
    loaded = store.load_state(run_id)
    assert loaded is not None and _same(loaded, state)


def test_a_round_refused_by_the_store_leaves_its_committed_checkpoint_as_it_was(tmp_path: Path) -> None:
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints="db")
    run_id = _run(store)
    first = _state(100, 1)
    store.commit_round(run_id, _record(1), first)
    with pytest.raises(StoreError, match="already has round 1"):
        store.commit_round(run_id, _record(1), _state(100, 7))  # the same round again: one transaction, undone
    loaded = store.load_state(run_id, 1)
    assert loaded is not None and _same(loaded, first)


def test_checkpoints_at_an_fsspec_url_and_a_missing_one_named(tmp_path: Path) -> None:
    bucket = f"memory://quorum-{uuid.uuid4().hex}/checkpoints"
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints=bucket)
    run_id = _run(store)
    state = _state(300, 1)
    store.commit_round(run_id, _record(1), state)
    reference = store.rounds(run_id)[0].checkpoint
    assert reference.startswith("memory://") and reference.endswith(f"/{run_id}/round-00001.safetensors")
    loaded = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints=bucket).load_state(run_id)  # another reader
    assert loaded is not None and _same(loaded, state)
    with pytest.raises(StoreError, match="set QUORUM_CHECKPOINTS to its URL"):  # a reader not told of the bucket
        RunStore(f"sqlite:///{tmp_path / 'runs.db'}").load_state(run_id)
    import fsspec

    fsspec.filesystem("memory").rm(reference.removeprefix("memory://"))
    with pytest.raises(StoreError, match=f"round 1 of run {run_id} is gone"):
        store.load_state(run_id)
    assert store.checkpoint_blob(run_id) is None


def test_where_checkpoints_go_by_default_and_by_setting(tmp_path: Path) -> None:
    beside = checkpoints_at(None, f"sqlite:///{tmp_path / 'runs.db'}")
    assert isinstance(beside, FolderCheckpoints) and beside.folder == tmp_path / "checkpoints"
    assert isinstance(checkpoints_at(None, "postgresql+psycopg://db.example/quorum"), DatabaseCheckpoints)
    assert isinstance(checkpoints_at("db", "sqlite:///x.db"), DatabaseCheckpoints)
    assert checkpoints_at("file:///srv/ckpt", "sqlite:///x.db") == FolderCheckpoints(Path("/srv/ckpt"))
    assert checkpoints_at("s3://bucket/prefix", "sqlite:///x.db") == UrlCheckpoints("s3://bucket/prefix")
    assert checkpoints_at(tmp_path, "sqlite:///x.db") == FolderCheckpoints(tmp_path)
    with pytest.raises(StoreError, match="empty setting"):
        checkpoints_at("  ", "sqlite:///x.db")


def test_a_folder_store_keeps_its_files_as_before(tmp_path: Path) -> None:
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = _run(store)
    store.commit_round(run_id, _record(1), _state(50, 1))
    assert (tmp_path / "checkpoints" / run_id / "round-00001.safetensors").is_file()
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(CheckpointChunk)) == 0


@settings(max_examples=200, deadline=None)
@given(data=st.one_of(st.binary(max_size=200),
                      st.builds(lambda n, rest: n.to_bytes(8, "little") + rest,
                                st.integers(0, 2**64 - 1), st.binary(max_size=100))))
def test_any_bytes_read_as_a_checkpoint_are_a_state_or_a_store_error(data: bytes) -> None:
    try:
        state = decode_state(data, "fuzz")
    except StoreError as exc:
        assert "cannot read checkpoint fuzz" in str(exc)
        return
    assert isinstance(state.params, np.ndarray)


def test_a_non_finite_state_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints="db")
    run_id = _run(store)
    bad = ServerState(params=np.array([1.0, np.nan], np.float32), round=1)
    with pytest.raises(StoreError, match="params hold NaN or Inf"):
        store.commit_round(run_id, _record(1), bad)
    assert store.rounds(run_id) == [] and store.checkpoint_blob(run_id) is None


def test_the_environment_names_where_every_process_keeps_checkpoints(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUORUM_CHECKPOINTS", "db")
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    assert isinstance(store.checkpoints, DatabaseCheckpoints)
    monkeypatch.setenv("QUORUM_CHECKPOINTS", str(tmp_path / "elsewhere"))
    assert RunStore(f"sqlite:///{tmp_path / 'runs.db'}").checkpoints == FolderCheckpoints(tmp_path / "elsewhere")
    # an explicit setting wins over the environment
    assert isinstance(RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints="db").checkpoints,
                      DatabaseCheckpoints)


@pytest.mark.parametrize("where", ["db", "folder", "memory"])
def test_whether_a_checkpoint_is_there_is_answered_without_reading_it(tmp_path: Path, where: str) -> None:
    setting = {"db": "db", "folder": str(tmp_path / "ckpt"), "memory": f"memory://q-{uuid.uuid4().hex}"}[where]
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints=setting)
    run_id = _run(store)
    assert not store.has_checkpoint(run_id)  # no round yet
    store.commit_round(run_id, _record(1), _state(20, 1))
    assert store.has_checkpoint(run_id) and store.has_checkpoint(run_id, 1) and not store.has_checkpoint(run_id, 2)


@pytest.mark.parametrize("forged", ["/etc/passwd", "file:///etc/passwd", "db:x/\u00b2", "db:other-run/1",
                                    "memory://elsewhere/RUN/round-00001.safetensors",
                                    "runs/checkpoints/RUN/../../../etc/RUN/round-00001.safetensors",
                                    "runs/checkpoints/other-run/round-00001.safetensors"])
def test_a_forged_checkpoint_reference_is_never_opened(tmp_path: Path, forged: str) -> None:
    # Prepare: a round whose row names something a round never writes (another run's, a system file, another bucket)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints=f"memory://q-{uuid.uuid4().hex}")
    run_id = _run(store)
    store.commit_round(run_id, _record(1), _state(10, 1))
    with store.session() as s, s.begin():
        s.execute(update(Round).where(Round.run_id == run_id).values(checkpoint=forged.replace("RUN", run_id)))

    # Execute / Assert: refused by name when loading; no checkpoint to show or serve
    with pytest.raises(StoreError, match="refused|not under this store|malformed"):
        store.load_state(run_id)
    assert not store.has_checkpoint(run_id) and store.checkpoint_source(run_id) is None
    assert store.checkpoint_blob(run_id) is None
