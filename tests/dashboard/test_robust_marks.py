"""The round page marks the clients whose update a robust aggregator clipped, trimmed or rejected."""

from __future__ import annotations

import warnings
from pathlib import Path

from dashboard_support import ROOT  # noqa: F401  (first: puts the repo on the path)

from dashboard.app import create_app
from dashboard.views import robust_mark
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def test_robust_mark_names_what_the_rule_did() -> None:
    assert robust_mark({"clipped": 1.0}) == "clipped"
    assert robust_mark({"rejected": 1.0}) == "rejected by the rule"
    assert robust_mark({"trimmed": 0.25}) == "trimmed 25%"
    assert robust_mark({"train-loss": 0.3}) == "" and robust_mark({"trimmed": 1e300}) == ""


def test_round_page_marks_the_updates_krum_rejected(tmp_path: Path) -> None:
    # Prepare: 5 clients, Krum with f = 1 keeps one update per round
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    scenario = tiny_scenario(rounds=1, federation={"clients": 5, "deadline_s": 300.0},
                             strategy={"name": "krum", "num_byzantine": 1},
                             faults={"byzantine": {"fraction": 0.2, "attack": "signflip"}})
    run_id = simulate(scenario, db_url=url).run_id

    # Execute
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        page = client.get(f"/runs/{run_id}/rounds/1").text

    # Assert
    assert page.count('data-field="robust-mark"') == 4
    assert page.count("rejected by the rule</span>") == 4


def test_dashboard_pages_name_deployed_devices(tmp_path: Path) -> None:
    # Prepare: a run whose info maps node ids to enrolled names, as a deployed ServerApp records it
    from runstore.store import RunStore
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id = simulate(tiny_scenario(rounds=1, federation={"clients": 2, "deadline_s": 300.0}), db_url=url).run_id
    store = RunStore(url)
    nodes = sorted({c.client for c in store.client_results(run_id, 1)})
    store.update_info(run_id, devices={nodes[0]: "ward-7 <b>", "999": "absent"})

    # Execute
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        page = client.get(f"/runs/{run_id}/rounds/1").text
        clients = client.get("/clients").text
        one = client.get(f"/clients/{nodes[0]}").text

    # Assert: the named node shows its name (escaped), with its id on hover; the other keeps its id
    assert f'title="node {nodes[0]}">ward-7 &lt;b&gt;</a>' in page
    assert f">{nodes[1]}</a>" in page and "absent" not in page
    assert f'title="node {nodes[0]}">ward-7 &lt;b&gt;</a>' in clients and f">{nodes[1]}</a>" in clients
    assert 'id="client-name">ward-7 &lt;b&gt;</span>' in one and f"node {nodes[0]}" in one
