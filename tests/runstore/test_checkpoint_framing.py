"""A checkpoint is read only when it is a regular file, or rows, whose safetensors framing is whole.

``TINY`` is round 1 of ``np.arange(4, dtype=float32)``: 16 bytes of data; a
header of 102 characters of JSON padded to 104 (``68 00 .. 00``, 0x68 = 104);
so 8 + 104 + 16 = 128 bytes, whose header needs its first 8 + 104 = 112.
A store's round (``_state``) holds 30 float32 of ``params`` (bytes 0 to 120
of the data) and of ``slot.m`` (120 to 240), under a header of 190
characters padded to 192: 8 + 192 + 240 = 440 bytes, the header's 200 first.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import delete
from sqlalchemy.orm import Session

from core.errors import StoreError
from core.records import RoundRecord
from core.strategy import ServerState
from runstore import checkpoints as ck
from runstore.blobs import check_frame
from runstore.checkpoints import CheckpointChunk, decode_state, encode_state
from runstore.store import RunStore

TINY = encode_state(ServerState(params=np.arange(4, dtype=np.float32), round=1), "tiny")


def _framed(header: object) -> bytes:
    """A blob of 8 bytes of length, then ``header`` as JSON, then no data."""
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text


def _check(blob: bytes) -> None:
    check_frame(lambda n: blob[:n], len(blob), "blob")


def _state(server_round: int) -> ServerState:
    rng = np.random.default_rng(server_round)
    return ServerState(params=rng.standard_normal(30).astype(np.float32),
                       slots={"m": rng.standard_normal(30).astype(np.float32)}, round=server_round,
                       wrapper_state={"dp": {"clip": 0.5}})


def _commit(store: RunStore, rounds: int = 1) -> str:
    run_id = store.create_run(name="ckpt", scenario={"name": "ckpt"}, seed=0, strategy="fedavg", rounds=rounds)
    for n in range(1, rounds + 1):
        store.commit_round(run_id, RoundRecord(round=n, started_at=0.0, duration_s=1.0, sampled=1, clients=[]),
                           _state(n))
    return run_id


def test_the_tiny_checkpoint_is_as_worked_out() -> None:
    assert len(TINY) == 128 and TINY[:8] == bytes.fromhex("6800000000000000")
    _check(TINY)  # whole: no error


@pytest.mark.parametrize(("blob", "why"), [
    (b"", "it holds 0 bytes, fewer than the 8 giving its header's length"),
    (TINY[:7], "it holds 7 bytes, fewer than the 8 giving its header's length"),
    (TINY[:100], "it holds 100 bytes, its header needs 112"),
    (TINY[:120], "tensor 'params' lies at bytes 0 to 16 of a data section of 8"),  # 120 - 112 = 8 data bytes
    (TINY + bytes(8), "it holds 136 bytes, its header describes 128"),
    (b"\xff" * 8 + TINY[8:], "its header claims 18,446,744,073,709,551,615 bytes, more than the 100,000,000 "
                            "allowed"),
    (_framed([]), "its header is a JSON list, not an object"),
    (_framed({"params": {"dtype": "F32"}}), "tensor 'params' has no data_offsets [begin, end]"),
    (_framed({"params": {"data_offsets": [0, True]}}), "tensor 'params' has no data_offsets [begin, end]"),
    (_framed({"params": {"data_offsets": [8, 4]}}) + bytes(8),
     "tensor 'params' lies at bytes 8 to 4 of a data section of 8"),
    (b"\x02" + bytes(7) + b"{x", "its header is not JSON (Expecting property name enclosed in double quotes: "
                                "line 1 column 2 (char 1))"),
], ids=lambda v: None if isinstance(v, str) else f"{len(v)}-bytes")  # the same ids in every xdist worker
def test_a_damaged_framing_is_named_in_one_line(blob: bytes, why: str) -> None:
    with pytest.raises(StoreError) as caught:
        _check(blob)
    assert str(caught.value) == f"blob is damaged: {why}"


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(st.binary(max_size=200), st.builds(lambda cut: TINY[:cut], st.integers(0, 200)),
                      st.builds(lambda n, rest: n.to_bytes(8, "little") + rest,
                                st.integers(0, 2**64 - 1), st.binary(max_size=100))))
def test_any_bytes_are_refused_as_damaged_or_pass_and_nothing_safetensors_reads_is_refused(data: bytes) -> None:
    try:
        _check(data)
    except StoreError as exc:
        assert str(exc).startswith("blob is damaged: ") and "\n" not in str(exc)
        with pytest.raises(StoreError):  # what the framing refuses, safetensors could not read either
            decode_state(data, "fuzz")


@pytest.mark.parametrize("where", ["folder", "db", "memory"])
def test_good_checkpoints_read_and_stream_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         where: str) -> None:
    # Prepare: three rounds, the blobs written kept (safetensors orders its metadata differently each time);
    # database chunks of 100 bytes, so a header of 200 spans two of them
    monkeypatch.setattr(ck, "CHUNK_BYTES", 100)
    setting = {"folder": str(tmp_path / "ckpt"), "db": "db", "memory": f"memory://q-{uuid.uuid4().hex}"}[where]
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints=setting)
    written: list[bytes] = []
    write = type(store.checkpoints).write

    def keep(self: ck.Checkpoints, session: Session, run: str, n: int, blob: bytes) -> str:
        written.append(blob)
        return write(self, session, run, n, blob)

    monkeypatch.setattr(type(store.checkpoints), "write", keep)
    run_id = _commit(store, rounds=3)

    # Execute
    blobs = [store.checkpoint_blob(run_id, n) for n in (1, 2, 3)]
    streamed = store.checkpoint_source(run_id, 2)

    # Assert: exactly what was written, whole or in pieces
    assert len(written) == 3 and blobs == [(n, written[n - 1]) for n in (1, 2, 3)]
    assert streamed is not None and streamed[0] == 2
    assert streamed[1].size == len(blobs[1][1]) and b"".join(streamed[1].pieces) == blobs[1][1]
    assert store.has_checkpoint(run_id, 3)


@pytest.fixture()
def damaged_file(tmp_path: Path) -> tuple[RunStore, str, Path]:
    """A folder store whose round 1 file is cut to its first 100 bytes (its header needs 200)."""
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = _commit(store)
    file = tmp_path / "checkpoints" / run_id / "round-00001.safetensors"
    assert len(file.read_bytes()) == 440
    file.write_bytes(file.read_bytes()[:100])
    return store, run_id, file


def test_a_resume_from_a_damaged_checkpoint_is_one_line_naming_it(damaged_file: tuple[RunStore, str, Path]) -> None:
    # Prepare
    store, run_id, file = damaged_file

    # Execute / Assert: load_state (a resume, an export) and checkpoint_blob refuse, naming the reference
    with pytest.raises(StoreError) as loading:
        store.load_state(run_id)
    with pytest.raises(StoreError) as serving:
        store.checkpoint_blob(run_id)
    assert str(loading.value) == f"checkpoint {file} is damaged: it holds 100 bytes, its header needs 200"
    assert str(serving.value) == (f"the checkpoint of round 1 of run {run_id} ({file}) is damaged: "
                                  "it holds 100 bytes, its header needs 200")
    assert not store.has_checkpoint(run_id)


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_a_checkpoint_that_is_not_a_regular_file_is_refused_without_being_read(tmp_path: Path, kind: str) -> None:
    # Prepare: the round's file replaced by a link to a good copy outside, a FIFO (would block a reader), a folder
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}")
    run_id = _commit(store)
    file = tmp_path / "checkpoints" / run_id / "round-00001.safetensors"
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(file.read_bytes())
    file.unlink()
    {"link": lambda: file.symlink_to(outside), "fifo": lambda: os.mkfifo(file), "folder": file.mkdir}[kind]()
    why = ("is not a regular file: round-00001.safetensors is a symbolic link; refused" if kind == "link"
           else "is not a regular file; refused")

    # Execute / Assert
    with pytest.raises(StoreError) as loading:
        store.load_state(run_id)
    with pytest.raises(StoreError) as serving:
        store.checkpoint_source(run_id)
    assert str(loading.value) == f"checkpoint {file} {why}"
    assert str(serving.value) == f"the checkpoint of round 1 of run {run_id} {why}"
    assert not store.has_checkpoint(run_id)


def test_a_database_checkpoint_missing_its_last_chunk_is_refused_on_resume(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 440 bytes in chunks of 100: four of 100, one of 40; deleting the last leaves 400
    monkeypatch.setattr(ck, "CHUNK_BYTES", 100)
    store = RunStore(f"sqlite:///{tmp_path / 'runs.db'}", checkpoints="db")
    run_id = _commit(store)
    with store.session() as s, s.begin():
        s.execute(delete(CheckpointChunk).where(CheckpointChunk.run_id == run_id, CheckpointChunk.seq == 4))

    # Execute
    with pytest.raises(StoreError) as loading:
        store.load_state(run_id)
    with pytest.raises(StoreError) as serving:
        store.checkpoint_blob(run_id)

    # Assert: 400 - 200 = 200 bytes of data: params (0 to 120) fits, slot.m (120 to 240) does not
    why = "is damaged: tensor 'slot.m' lies at bytes 120 to 240 of a data section of 200"
    assert str(loading.value) == f"checkpoint db:{run_id}/1 {why}"
    assert str(serving.value) == f"the checkpoint of round 1 of run {run_id} (db:{run_id}/1) {why}"
