"""Sites that refused under their own policy, on the dashboard: the round's count and each client's rule (issue 48)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from dashboard_support import state

from core.records import ClientRecord, RoundRecord
from dashboard.app import create_app
from runstore.store import RunStore

with warnings.catch_warnings():  # starlette's import-time deprecations, as in conftest.py
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

RULE = "secure aggregation required"


def test_the_run_and_round_pages_show_the_refusals_and_their_rule(tmp_path: Path) -> None:
    # Prepare: a round of three, two refused by their policy
    url = f"sqlite:///{tmp_path / 'quorum.db'}"
    store = RunStore(url)
    run_id = store.create_run(name="policed", scenario={"name": "policed"}, seed=1, strategy="fedavg", rounds=1)
    clients = [ClientRecord(client="1", outcome="refused", stage="train", reason=RULE),
               ClientRecord(client="2", outcome="refused", stage="train", reason=RULE),
               ClientRecord(client="3", outcome="ok", num_examples=10)]
    store.commit_round(run_id, RoundRecord(round=1, started_at=1000.0, duration_s=1.0, sampled=3, clients=clients,
                                           metrics={"status": "ok"}), state(1))
    store.set_status(run_id, "degraded", f"2 of 3 sites refused: {RULE} (client 1, client 2)")

    # Execute
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        run_page = client.get(f"/runs/{run_id}").text
        round_page = client.get(f"/runs/{run_id}/rounds/1").text
        rounds = client.get(f"/api/runs/{run_id}/rounds").json()

    # Assert: the count in its own column and card, each refused client with its rule, the run's reason
    row = re.search(r'<tr data-round="1">(.*?)</tr>', run_page, re.S)[1]
    assert 'data-key="refused"' in run_page and '<td class="num warn">2</td>' in row
    assert "Refused (site policy)" in round_page
    assert round_page.count(f"refused by its site policy at train: {RULE}") == 2
    assert f"2 of 3 sites refused: {RULE} (client 1, client 2)" in run_page
    assert rounds[0]["metrics"]["refused"] == 2 and rounds[0]["answered"] == 1


def test_the_api_round_counts_refusals_in_a_field_of_its_own(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    store = RunStore(url)
    run_id = store.create_run(name="r", scenario={"name": "r"}, seed=0, strategy="fedavg", rounds=1)
    clients = [ClientRecord("1", "ok", num_examples=3), ClientRecord("2", "refused", stage="train", reason="x"),
               ClientRecord("3", "refused", stage="train", reason="y")]
    store.commit_round(run_id, RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=3, clients=clients),
                       state(1))
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        got = client.get(f"/api/runs/{run_id}/rounds/1").json()
    assert (got["answered"], got["refused"]) == (1, 2)
