"""The dashboard serves a checkpoint only when it is a regular file, or rows, whose safetensors framing is whole.

Every checkpoint here is round 1 of ``np.arange(300, dtype=float32) / 7``:
1,200 bytes of data; a header of 106 characters of JSON padded to 112; so
8 + 112 + 1,200 = 1,320 bytes, whose header needs its first 8 + 112 = 120.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import delete, func, update

from core.records import RoundRecord
from core.strategy import ServerState
from dashboard.app import create_app
from runstore import checkpoints
from runstore.checkpoints import CheckpointChunk
from runstore.store import RunStore

with warnings.catch_warnings():  # starlette's import-time deprecations, not ours (tests/dashboard/conftest.py)
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient
    from httpx import Response

SECRET = b"root:x:0:0:the secret a symbolic link would leak\n"
DAMAGED = "the checkpoint of round 1 of run {run} is damaged: "


def _commit(store: RunStore) -> str:
    run_id = store.create_run(name="ckpt", scenario={"name": "ckpt"}, seed=0, strategy="fedavg", rounds=1)
    store.commit_round(run_id, RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=1, clients=[]),
                       ServerState(params=np.arange(300, dtype=np.float32) / 7, round=1))
    return run_id


@pytest.fixture()
def folder_run(tmp_path: Path) -> tuple[str, str, Path]:
    """A SQLite store with its checkpoints in the folder beside it: (store URL, run, round 1's file)."""
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id = _commit(RunStore(url))
    return url, run_id, tmp_path / "checkpoints" / run_id / "round-00001.safetensors"


def _get(url: str, *paths: str) -> list[Response]:
    """The answers of a dashboard on the store at ``url`` to ``paths``, read whole.

    Asked for no gzip, so that a download's ``content-length`` is the checkpoint's own.
    """
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        return [client.get(path, headers={"accept-encoding": "identity"}) for path in paths]


def test_a_good_file_checkpoint_is_served_byte_for_byte_with_its_length(folder_run: tuple[str, str, Path]) -> None:
    # Prepare
    url, run_id, file = folder_run

    # Execute
    (response,) = _get(url, f"/api/runs/{run_id}/checkpoint")

    # Assert: the file's 1,320 bytes, as they are on disk
    assert response.status_code == 200 and response.content == file.read_bytes() and len(response.content) == 1320
    assert response.headers["content-length"] == "1320"
    assert f'filename="{run_id}-round-00001.safetensors"' in response.headers["content-disposition"]


def test_a_truncated_file_checkpoint_is_refused_in_one_line(folder_run: tuple[str, str, Path]) -> None:
    # Prepare: the file cut to its first 100 bytes (its header alone needs 120)
    url, run_id, file = folder_run
    file.write_bytes(file.read_bytes()[:100])

    # Execute
    response, round_page = _get(url, f"/api/runs/{run_id}/checkpoint", f"/runs/{run_id}/rounds/1")

    # Assert: a 409 naming why, in one line; the round page no longer offers it
    assert response.status_code == 409
    detail = response.json()["detail"]
    assert detail == DAMAGED.format(run=run_id) + "it holds 100 bytes, its header needs 120"
    assert "\n" not in detail and str(file) not in detail  # the server's path stays on the server
    assert round_page.status_code == 200 and f"/api/runs/{run_id}/checkpoint?round=1" not in round_page.text


def test_a_header_claiming_a_terabyte_is_refused_before_anything_is_read(folder_run: tuple[str, str, Path]) -> None:
    # Prepare: the first 8 bytes claim a header of 2**40 = 1,099,511,627,776 bytes
    url, run_id, file = folder_run
    file.write_bytes((2**40).to_bytes(8, "little") + file.read_bytes()[8:])

    # Execute
    (response,) = _get(url, f"/api/runs/{run_id}/checkpoint")

    # Assert
    assert response.status_code == 409
    assert response.json()["detail"] == (DAMAGED.format(run=run_id) + "its header claims 1,099,511,627,776 bytes, "
                                         "more than the 100,000,000 allowed")


@pytest.mark.parametrize("target", ["secret", "model"])
def test_a_checkpoint_file_replaced_by_a_symbolic_link_is_never_followed(folder_run: tuple[str, str, Path],
                                                                        tmp_path: Path, target: str) -> None:
    # Prepare: the round's file becomes a link to a secret outside the store, or to a whole model outside it
    url, run_id, file = folder_run
    outside = tmp_path / "outside.bin"
    outside.write_bytes(SECRET if target == "secret" else file.read_bytes())
    file.unlink()
    file.symlink_to(outside)

    # Execute
    response, run_page = _get(url, f"/api/runs/{run_id}/checkpoint", f"/runs/{run_id}")

    # Assert: refused as no regular file, whatever the link points at; the secret's bytes never leave
    assert response.status_code == 409 and SECRET not in response.content and b"\x00" not in response.content
    assert response.json()["detail"] == (f"the checkpoint of round 1 of run {run_id} is not a regular file: "
                                         "round-00001.safetensors is a symbolic link; refused")
    assert "hidden download" in " ".join(run_page.text.split())  # the run page's download button is hidden


def test_a_run_folder_replaced_by_a_symbolic_link_is_never_followed(folder_run: tuple[str, str, Path],
                                                                   tmp_path: Path) -> None:
    # Prepare: the run's folder moved outside the store, a link to it left in its place
    url, run_id, file = folder_run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    file.parent.rename(elsewhere / run_id)
    file.parent.symlink_to(elsewhere / run_id, target_is_directory=True)

    # Execute
    (response,) = _get(url, f"/api/runs/{run_id}/checkpoint")

    # Assert
    assert response.status_code == 409 and SECRET not in response.content
    assert response.json()["detail"] == (f"the checkpoint of round 1 of run {run_id} is not a regular file: "
                                         f"{run_id} is a symbolic link; refused")


@pytest.fixture()
def database_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """A store keeping its checkpoints in the database, in chunks of 64 bytes: (store URL, run).

    1,320 bytes make 21 chunks: 20 of 64 (1,280 bytes), then one of 40.
    """
    monkeypatch.setattr(checkpoints, "CHUNK_BYTES", 64)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    return url, _commit(RunStore(url, checkpoints="db"))


def test_a_good_database_checkpoint_is_served_whole_with_its_length(database_run: tuple[str, str]) -> None:
    # Prepare
    url, run_id = database_run
    expected = RunStore(url, checkpoints="db").checkpoint_blob(run_id)

    # Execute
    (response,) = _get(url, f"/api/runs/{run_id}/checkpoint")

    # Assert
    assert expected is not None and response.status_code == 200 and response.content == expected[1]
    assert len(response.content) == 1320 and response.headers["content-length"] == "1320"


@pytest.mark.parametrize(("cut", "why"), [
    # the last chunk's 40 bytes gone: 1,280 bytes, a data section of 1,280 - 120 = 1,160
    ("last chunk", "tensor 'params' lies at bytes 0 to 1,200 of a data section of 1,160"),
    # the last chunk cut to 10 bytes: 1,280 + 10 = 1,290 bytes, a data section of 1,290 - 120 = 1,170
    ("last chunk's data", "tensor 'params' lies at bytes 0 to 1,200 of a data section of 1,170"),
    # every chunk after the first: 64 bytes, short of the 120 of the header
    ("all but the first", "it holds 64 bytes, its header needs 120"),
    ("a middle chunk", "its chunk 7 is missing"),
])
def test_a_truncated_database_checkpoint_is_refused_in_one_line(database_run: tuple[str, str], cut: str,
                                                               why: str) -> None:
    # Prepare
    url, run_id = database_run
    mine = (CheckpointChunk.run_id == run_id, CheckpointChunk.round == 1)
    statement = {"last chunk": delete(CheckpointChunk).where(*mine, CheckpointChunk.seq == 20),
                 "last chunk's data": update(CheckpointChunk).where(*mine, CheckpointChunk.seq == 20).values(
                     data=func.substr(CheckpointChunk.data, 1, 10)),
                 "all but the first": delete(CheckpointChunk).where(*mine, CheckpointChunk.seq > 0),
                 "a middle chunk": delete(CheckpointChunk).where(*mine, CheckpointChunk.seq == 7)}[cut]
    store = RunStore(url, checkpoints="db")
    with store.session() as s, s.begin():
        s.execute(statement)

    # Execute
    (response,) = _get(url, f"/api/runs/{run_id}/checkpoint")

    # Assert
    assert response.status_code == 409 and response.json()["detail"] == DAMAGED.format(run=run_id) + why
    assert not store.has_checkpoint(run_id)


def test_a_truncated_object_store_checkpoint_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: an object cut to its first 100 bytes in fsspec's memory:// store
    import fsspec

    bucket = f"memory://quorum-{tmp_path.name}/damaged"
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id = _commit(RunStore(url, checkpoints=bucket))
    path = f"/quorum-{tmp_path.name}/damaged/{run_id}/round-00001.safetensors"
    memory = fsspec.filesystem("memory")
    memory.pipe(path, memory.cat(path)[:100])
    monkeypatch.setenv("QUORUM_CHECKPOINTS", bucket)

    # Execute
    (response,) = _get(url, f"/api/runs/{run_id}/checkpoint")

    # Assert
    assert response.status_code == 409
    assert response.json()["detail"] == DAMAGED.format(run=run_id) + "it holds 100 bytes, its header needs 120"
