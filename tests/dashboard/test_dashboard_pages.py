"""Server-rendered pages over the filled store."""

from __future__ import annotations

import json
import re

from dashboard_support import FilledStore
from fastapi.testclient import TestClient

from dashboard.views import fmt_bytes, fmt_duration, outcome_text, scenario_text, secagg_table


def test_runs_page_lists_runs_and_filters_by_status(client: TestClient, filled_store: FilledStore) -> None:
    page = client.get("/").text
    filtered = client.get("/?status=stopped_budget").text
    assert filled_store.sim_run in page and "quickstart" in page and "2 / 2" in page
    assert filled_store.dp_run in filtered and filled_store.sim_run not in filtered
    assert 'class="chip active" href="/?status=stopped_budget"' in filtered


def test_runs_page_is_paged_newest_first(client: TestClient) -> None:
    # Prepare
    newest_first = [r["id"] for r in client.get("/api/runs").json()]
    # Execute
    first, second, beyond = (client.get(f"/?per_page=2&page={n}").text for n in (1, 2, 9))
    # Assert: 3 runs at 2 a page; a page past the end shows the last one
    assert re.findall(r'<tr data-run-id="([^"]+)"', first) == newest_first[:2]
    assert re.findall(r'<tr data-run-id="([^"]+)"', second) == newest_first[2:]
    assert "Runs 1&ndash;2 of 3 &middot; page 1 of 2" in first and 'href="/?page=2&amp;per_page=2">Older' in first
    assert "Runs 3&ndash;3 of 3" in second and 'href="/?page=1&amp;per_page=2">&larr; Newer' in second
    assert "Older" not in second and "page 2 of 2" in beyond
    assert re.findall(r'<tr data-run-id="([^"]+)"', beyond) == newest_first[2:]
    assert 'class="pager"' not in client.get("/").text  # one page: no pager


def test_run_page_has_charts_table_scenario_and_downloads(client: TestClient, filled_store: FilledStore) -> None:
    page = client.get(f"/runs/{filled_store.sim_run}").text
    data = json.loads(re.search(r'<script type="application/json" id="run-data">(.*?)</script>', page, re.S)[1])
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    for chart in ("chart-accuracy", "chart-loss", "chart-clients", "chart-duration", "chart-traffic", "chart-bytes"):
        assert f'id="{chart}"' in page
    assert '/static/vendor/plotly/plotly.min.js' in page
    assert f'href="/runs/{filled_store.sim_run}/rounds/2"' in page
    assert f'/api/runs/{filled_store.sim_run}/checkpoint"' in page and "metrics.csv" in page
    assert '[federation]\nclients = 20' in page  # the scenario, TOML-like
    assert 'id="panel-epsilon" hidden' in page and 'id="panel-secagg" hidden' in page  # no DP, no secagg
    assert 'id="panel-staleness" hidden' in page  # shown by run.js for an asynchronous run's steps


def test_run_page_shows_epsilon_and_secagg_when_recorded(client: TestClient, filled_store: FilledStore) -> None:
    page = client.get(f"/runs/{filled_store.dp_run}").text
    assert "Privacy spent ε" in page and ">0.750<" in page
    assert 'id="panel-epsilon" hidden' not in page and 'id="panel-secagg" hidden' not in page


def test_round_page_shows_each_clients_outcome(client: TestClient, filled_store: FilledStore) -> None:
    clients = client.get(f"/api/runs/{filled_store.sim_run}/rounds/1/clients").json()
    page = client.get(f"/runs/{filled_store.sim_run}/rounds/1").text
    assert page.count("<tr data-client=") == len(clients)
    dropped = [c for c in clients if c["outcome"] == "dropped"]
    assert dropped and all(c["description"] in page for c in dropped)
    assert "Round 2 &rarr;" in page


def test_round_page_renders_secagg_stages_generically(client: TestClient, filled_store: FilledStore) -> None:
    page = client.get(f"/runs/{filled_store.dp_run}/rounds/2").text
    table = page[page.index('id="secagg-table"'):]
    header = re.findall(r"<th>(.*?)</th>", table[:table.index("</thead>")])
    assert header == ["stage", "completed", "seconds", "bytes up"]
    assert "<td>unmask</td><td>2</td><td>—</td><td>1024</td>" in table


def test_clients_pages(client: TestClient, filled_store: FilledStore) -> None:
    listing = client.get(f"/clients?run={filled_store.sim_run}").text
    first = client.get(f"/api/clients?run={filled_store.sim_run}").json()[0]
    history = client.get(f"/clients/{first['client']}").text
    assert listing.count("<tr data-client=") == len(client.get(f"/api/clients?run={filled_store.sim_run}").json())
    assert f'<option value="{filled_store.sim_run}" selected>' in listing
    assert "Last seen" in listing and "History" in history
    assert client.get("/clients/nobody").status_code == 404


def test_unknown_pages_are_404_pages(client: TestClient) -> None:
    response = client.get("/runs/no-such-run")
    assert response.status_code == 404 and "text/html" in response.headers["content-type"]
    assert "no-such-run" in response.text and "Back to runs" in response.text
    assert client.get("/runs/no-such-run/rounds/1").status_code == 404


def test_display_formatting() -> None:
    assert fmt_duration(4.94) == "4.9 s"
    assert fmt_duration(65) == "1 min 05 s"
    assert fmt_duration(7380) == "2 h 03 min"
    assert fmt_bytes(999) == "999 B" and fmt_bytes(4_573_840) == "4.6 MB"
    assert outcome_text("dropped", "unmask", None) == "dropped at unmask"
    assert outcome_text("rejected", "train", "update has NaN") == "rejected at train: update has NaN"
    assert outcome_text("ok", None, None) == "ok"


def test_scenario_text_is_toml_like() -> None:
    text = scenario_text({"name": "q", "rounds": 3, "dp": {"enabled": False, "noise": None},
                          "faults": {"dropouts": {"train": 0.1}}})
    assert text == ('name = "q"\nrounds = 3\n\n[dp]\nenabled = false\n# noise is not set\n\n'
                    '[faults]\n\n[faults.dropouts]\ntrain = 0.1\n')


def test_secagg_table_falls_back_to_key_value_rows() -> None:
    assert secagg_table({"survivors": 7, "graph": "complete"}) == (
        ["key", "value"], [["survivors", "7"], ["graph", "complete"]])
