"""The dashboard serves a checkpoint kept in the database: a dashboard on another host reads the model too."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from core.records import RoundRecord
from core.strategy import ServerState
from dashboard.app import create_app
from runstore import checkpoints
from runstore.checkpoints import decode_state
from runstore.store import RunStore

with warnings.catch_warnings():  # starlette's import-time deprecations, not ours (tests/dashboard/conftest.py)
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def test_a_checkpoint_in_the_database_is_served_by_a_dashboard_with_no_checkpoint_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the aggregator writes round 1's checkpoint into the database, in chunks of 64 bytes (streamed)
    monkeypatch.setattr(checkpoints, "CHUNK_BYTES", 64)
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    store = RunStore(url, checkpoints="db")
    run_id = store.create_run(name="db", scenario={"name": "db"}, seed=0, strategy="fedavg", rounds=1)
    params = np.arange(300, dtype=np.float32) / 7  # about 1.3 kB: twenty-odd chunks
    store.commit_round(run_id, RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=1, clients=[]),
                       ServerState(params=params, round=1))

    # Execute: a dashboard on the same URL (its own default would be a folder beside the database)
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        page = client.get(f"/runs/{run_id}")
        response = client.get(f"/api/runs/{run_id}/checkpoint")
        missing = client.get(f"/api/runs/{run_id}/checkpoint", params={"round": 2})

    # Assert: the exact model, named for download; the run page offers it; a round without one is a 404
    assert response.status_code == 200 and response.headers["content-type"] == "application/octet-stream"
    np.testing.assert_array_equal(decode_state(response.content, "served").params, params)
    assert f'filename="{run_id}-round-00001.safetensors"' in response.headers["content-disposition"]
    assert page.status_code == 200 and f"/api/runs/{run_id}/checkpoint" in page.text
    assert missing.status_code == 404
    assert not (tmp_path / "checkpoints").exists()


def test_an_object_store_checkpoint_is_served_in_pieces_to_a_dashboard_told_of_the_bucket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: checkpoints in an object store (fsspec's memory://), read back in 100-byte pieces
    bucket = f"memory://quorum-{tmp_path.name}/ckpt"
    monkeypatch.setattr(checkpoints, "CHUNK_BYTES", 100)
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    store = RunStore(url, checkpoints=bucket)
    run_id = store.create_run(name="s3", scenario={"name": "s3"}, seed=0, strategy="fedavg", rounds=1)
    params = np.arange(200, dtype=np.float32) / 3
    store.commit_round(run_id, RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=1, clients=[]),
                       ServerState(params=params, round=1))

    # Execute: one dashboard with the bucket in QUORUM_CHECKPOINTS, one without
    monkeypatch.setenv("QUORUM_CHECKPOINTS", bucket)
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        served = client.get(f"/api/runs/{run_id}/checkpoint")
    monkeypatch.delenv("QUORUM_CHECKPOINTS")
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        untold = client.get(f"/api/runs/{run_id}/checkpoint")

    # Assert: the exact model; a dashboard not told of the bucket opens nothing and says there is none
    assert served.status_code == 200
    np.testing.assert_array_equal(decode_state(served.content, "served").params, params)
    assert untold.status_code == 404
