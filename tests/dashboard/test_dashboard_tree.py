"""Edge aggregators ([hierarchy]) on the dashboard: the round page's edges table, the API's tree, /metrics.

A real tree run (12 devices under 3 edges, every device sampled) is checked
against what the run must give: 3 edges of 4 devices, each answering 4, each
device under edge ``(id - 1) // 4``, the edges' partial sums adding up to the
round's upload. Hand-written trees cover what a real small run does not show
(a refused edge, the secure sum across the edges, more than 1,000 edges), and
hypothesis writes any JSON into ``rounds.tree``: no page, API answer or
scrape is ever a 5xx.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from dashboard_support import state
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

from core.records import ClientRecord, RoundRecord
from dashboard.app import create_app
from dashboard.views import EDGE_BYTES, EDGE_COUNTS, MAX_EDGES, fmt_bytes
from runstore.store import Round, RunStore
from tests.conftest import tiny_scenario

DASH = "\u2014"
#: The issue's example: edge 0 as a sub-round records it, edge 1 refused (no "dropped", "failed", "seconds").
EXAMPLE = {"edges": [{"edge": 0, "sampled": 4, "answered": 4, "dropped": 0, "rejected": 0, "failed": 0, "refused": 0,
                      "seconds": 0.13, "bytes_down": 4397, "bytes_up": 3900, "bytes_devices": 13804},
                     {"edge": 1, "sampled": 4, "answered": 0, "rejected": 4, "bytes_down": 4397, "bytes_up": 3900,
                      "problem": "edge 1's partial sum refused: weight 400 is not the 40 its devices' example "
                                 "counts give"}],
           "seconds": 0.14, "bytes_devices": 41412,
           "secure_across_edges": {"edges": 3, "survivors": 3, "error_bound": 1.2e-12, "bytes_up": 18057,
                                   "bytes_down": 3189}}
SECURE_LINES = {  # the secure sum across the edges as recorded -> the line the round page shows
    "summed": (EXAMPLE["secure_across_edges"],
               "secure sum across 3 edges: 3 survived, error bound 1.2e-12, 18.1 kB up, 3.2 kB down"),
    "aborted": ({"edges": 3, "aborted": "2 of 3 edges answered"}, "secure sum across 3 edges aborted: 2 of 3 "
                                                                  "edges answered"),
    "refused": ({"edges": 3, "refused": "its weight 9 is not the 8 the edges declared"},
                "secure sum across 3 edges refused: its weight 9 is not the 8 the edges declared"),
}


@dataclass(frozen=True)
class TreeRuns:
    url: str
    tree: str  # a real run: 12 devices under 3 edges, 2 rounds
    flat: str  # the same scenario without [hierarchy]
    example: str  # rounds 1-3: EXAMPLE with each of SECURE_LINES; round 4: 1,200 edges (and edge 7 twice)
    junk: str  # one round whose tree hypothesis overwrites


def _commit(store: RunStore, run_id: str, number: int, tree: Any, clients: list[ClientRecord] | None = None) -> None:
    store.commit_round(run_id, RoundRecord(round=number, started_at=1000.0 + number, duration_s=1.0, sampled=8,
                                           clients=clients or [], tree=tree), state(number))


def _example_runs(store: RunStore) -> tuple[str, str]:
    example = store.create_run(name="edges-example", scenario={"name": "edges-example"}, seed=0, strategy="fedavg",
                               rounds=4)
    devices = [ClientRecord(client=str(d), outcome="ok" if d <= 4 else "rejected", num_examples=10,
                            metrics={"edge": (d - 1) // 4}) for d in range(1, 9)]
    for number, (secure, _) in enumerate(SECURE_LINES.values(), start=1):
        _commit(store, example, number, {**EXAMPLE, "secure_across_edges": secure}, devices)
    many = [{"edge": e, "sampled": 1, "answered": 1, "seconds": 0.01, "bytes_up": 10 + e} for e in range(1200)]
    _commit(store, example, 4, {"edges": [many[7], *many]})  # edge 7 twice: /metrics keeps its first row
    junk = store.create_run(name="edges-junk", scenario={"name": "edges-junk"}, seed=0, strategy="fedavg", rounds=1)
    _commit(store, junk, 1, EXAMPLE, devices)
    return example, junk


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> TreeRuns:
    from runtimes.simulation import simulate

    url = f"sqlite:///{tmp_path_factory.mktemp('tree') / 'quorum.db'}"
    federation = {"clients": 12, "weighting": "capped"}
    tree = simulate(tiny_scenario(rounds=2, federation=federation, hierarchy={"edges": 3}), db_url=url, workers=1)
    flat = simulate(tiny_scenario(rounds=1, federation=federation), db_url=url, workers=1)
    example, junk = _example_runs(RunStore(url))
    return TreeRuns(url=url, tree=tree.run_id, flat=flat.run_id, example=example, junk=junk)


@pytest.fixture(scope="module")
def site(runs: TreeRuns) -> Iterator[TestClient]:
    with TestClient(create_app(runs.url), base_url="http://127.0.0.1") as test_client:
        yield test_client


def _edge_rows(page: str) -> dict[str, dict[str, str]]:
    """The edges table of a round page: edge -> {field: shown text}."""
    table = re.search(r'<table class="data" id="edges-table">(.*?)</table>', page, re.S)
    assert table is not None, "no edges table"
    rows = re.findall(r'<tr data-edge="([^"]*)"[^>]*>(.*?)</tr>', table[1], re.S)
    return {edge: dict(re.findall(r'data-field="([a-z_]+)">(.*?)</td>', cells, re.S)) for edge, cells in rows}


def _device_edges(page: str) -> dict[str, str]:
    """The clients table of a round page: client -> the edge its row shows."""
    rows = re.findall(r'<tr data-client="([^"]+)">(.*?)</tr>', page, re.S)
    return {client: re.search(r'data-field="edge"><a href="#edge-(\d+)">\1</a>', cells)[1] for client, cells in rows}


def _samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def _edge_series(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], run_id: str
                 ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(name, tuple(kv for kv in labels if kv[0] != "run")): value for (name, labels), value in samples.items()
            if name.startswith("quorum_edge_") and ("run", run_id) in labels}


# -- a real tree run ----------------------------------------------------------------------------------------------
def test_round_page_shows_each_edge_of_a_real_tree_run(site: TestClient, runs: TreeRuns) -> None:
    # Prepare: what the run recorded
    stored = RunStore(runs.url).rounds(runs.tree)[0]
    tree = stored.tree
    # Execute
    page = site.get(f"/runs/{runs.tree}/rounds/1").text
    edges = _edge_rows(page)
    # Assert: 3 edges of 4 devices, each answering all 4, as the run must give
    assert list(edges) == ["0", "1", "2"]
    for row in edges.values():
        assert {k: row[k] for k in EDGE_COUNTS} == {"sampled": "4", "answered": "4", "dropped": "0", "rejected": "0",
                                                    "failed": "0", "refused": "0"}
        assert row["problem"] == ""
    # each edge's time and traffic as recorded; the partial sums and instructions are the round's own traffic
    for row, recorded in zip(edges.values(), tree["edges"], strict=True):
        assert row["seconds"] == f"{recorded['seconds']:.2f} s"
        assert [row[key] for _, key in EDGE_BYTES] == [fmt_bytes(recorded[key]) for _, key in EDGE_BYTES]
    assert sum(e["bytes_up"] for e in tree["edges"]) == stored.bytes_in
    assert sum(e["bytes_down"] for e in tree["edges"]) == stored.bytes_out
    assert sum(e["bytes_devices"] for e in tree["edges"]) == tree["bytes_devices"]
    assert f"their devices sent them {fmt_bytes(tree['bytes_devices'])}" in page
    assert 'id="secure-across-edges"' not in page  # no secure sum across the edges in this run


def test_round_page_shows_each_devices_edge(site: TestClient, runs: TreeRuns) -> None:
    page = site.get(f"/runs/{runs.tree}/rounds/2").text
    # devices 1-4 under edge 0, 5-8 under edge 1, 9-12 under edge 2 (docs/hierarchy.md), each linked to its row
    assert _device_edges(page) == {str(d): str((d - 1) // 4) for d in range(1, 13)}
    others = re.findall(r'<td class="small mono">(.*?)</td>', page)
    assert len(others) == 12 and not any("edge" in cell for cell in others)  # a column of its own, not in these


def test_api_serves_the_rounds_tree_and_null_for_a_flat_round(site: TestClient, runs: TreeRuns) -> None:
    stored = RunStore(runs.url).rounds(runs.tree)
    one = site.get(f"/api/runs/{runs.tree}/rounds/1").json()
    listed = site.get(f"/api/runs/{runs.tree}/rounds").json()
    flat = site.get(f"/api/runs/{runs.flat}/rounds/1").json()
    assert one["tree"] == stored[0].tree and len(one["tree"]["edges"]) == 3
    assert [r["tree"] for r in listed] == [r.tree for r in stored]
    assert flat["tree"] is None
    schema = site.get("/openapi.json").json()["components"]["schemas"]["RoundOut"]["properties"]["tree"]
    assert "Edge aggregators" in schema["description"]


def test_metrics_have_each_edges_figures_of_the_last_round(site: TestClient, runs: TreeRuns) -> None:
    # Prepare: the last round's tree
    last = RunStore(runs.url).rounds(runs.tree)[-1].tree
    # Execute
    series = _edge_series(_samples(site), runs.tree)
    # Assert: one series per edge and outcome, time and direction, with the last round's values
    for recorded in last["edges"]:
        edge = ("edge", str(recorded["edge"]))
        for outcome in EDGE_COUNTS:
            assert series[("quorum_edge_devices", (edge, ("outcome", outcome)))] == (
                4 if outcome in ("sampled", "answered") else 0)
        assert series[("quorum_edge_round_seconds", (edge,))] == recorded["seconds"]
        for direction, key in EDGE_BYTES:
            assert series[("quorum_edge_bytes", (("direction", direction), edge))] == recorded[key]
        assert series[("quorum_edge_problem", (edge,))] == 0
    assert len(series) == 3 * (len(EDGE_COUNTS) + 1 + len(EDGE_BYTES) + 1)
    assert _edge_series(_samples(site), runs.flat) == {}  # a flat run has no edge series


def test_a_flat_round_has_no_edges_table_and_no_edge_column(site: TestClient, runs: TreeRuns) -> None:
    page = site.get(f"/runs/{runs.flat}/rounds/1").text
    assert page.count("<tr data-client=") == 12  # its clients are there
    assert 'id="edges"' not in page and "Edge aggregators" not in page and 'data-field="edge"' not in page


def test_run_page_charts_carry_no_tree(site: TestClient, runs: TreeRuns) -> None:
    page = site.get(f"/runs/{runs.tree}").text
    assert '"tree"' not in page and "bytes_devices" not in page  # one row per edge each round: the API has them


# -- hand-written trees -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("number,outcome", [(1, "summed"), (2, "aborted"), (3, "refused")],
                         ids=["summed", "aborted", "refused"])
def test_round_page_shows_a_refused_edge_and_the_secure_sum(site: TestClient, runs: TreeRuns, number: int,
                                                            outcome: str) -> None:
    page = site.get(f"/runs/{runs.example}/rounds/{number}").text
    edges = _edge_rows(page)
    # the refused edge: its reason, and a dash for what its row did not record
    assert edges["1"]["problem"] == EXAMPLE["edges"][1]["problem"].replace("'", "&#39;")
    assert (edges["1"]["rejected"], edges["1"]["dropped"], edges["1"]["failed"]) == ("4", DASH, DASH)
    assert (edges["1"]["seconds"], edges["1"]["bytes_devices"], edges["1"]["bytes_up"]) == (DASH, DASH, "3.9 kB")
    assert (edges["0"]["seconds"], edges["0"]["problem"]) == ("0.13 s", "")
    line = re.search(r'<p class="notice small" id="secure-across-edges">(.*?)</p>', page)
    assert line is not None and line[1] == SECURE_LINES[outcome][1]
    assert _device_edges(page) == {str(d): str((d - 1) // 4) for d in range(1, 9)}


def test_more_edges_than_shown_are_cut_at_1000(site: TestClient, runs: TreeRuns) -> None:
    # Execute: round 4 recorded 1,201 edge rows (edge 7 twice); it is the run's last round
    page = site.get(f"/runs/{runs.example}/rounds/4").text
    series = _edge_series(_samples(site), runs.example)
    # Assert: the page lists the first 1,000 and says so; /metrics has 1,000 series of each kind, edge 7 once
    assert page.count("<tr data-edge=") == MAX_EDGES
    assert page.count('id="edge-7"') == 1  # its second row is listed, but the devices' links go to its first
    assert "The first 1,000 of 1,201 edges are listed." in page
    answered = {labels: v for (name, labels), v in series.items() if name == "quorum_edge_devices"
                and ("outcome", "answered") in labels}
    assert len(answered) == MAX_EDGES - 1  # the first 1,000 rows, edge 7's second one left out
    assert series[("quorum_edge_bytes", (("direction", "up"), ("edge", "7")))] == 17
    assert ("quorum_edge_devices", (("edge", "7"), ("outcome", "dropped"))) not in series  # not recorded: no series


def test_metrics_flag_an_edge_with_a_problem(tmp_path: Any) -> None:
    # Prepare: a run whose last round is the example (edge 1 refused)
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    store = RunStore(url)
    run_id = store.create_run(name="refused", scenario={}, seed=0, strategy="fedavg", rounds=1)
    _commit(store, run_id, 1, EXAMPLE)
    # Execute
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        series = _edge_series(_samples(client), run_id)
    # Assert
    assert series[("quorum_edge_problem", (("edge", "0"),))] == 0
    assert series[("quorum_edge_problem", (("edge", "1"),))] == 1
    assert series[("quorum_edge_devices", (("edge", "1"), ("outcome", "rejected")))] == 4
    assert ("quorum_edge_round_seconds", (("edge", "1"),)) not in series  # its sub-round recorded no time
    assert series[("quorum_edge_round_seconds", (("edge", "0"),))] == 0.13


# -- junk in the store ------------------------------------------------------------------------------------------
_KEYS = ["edge", *EDGE_COUNTS, "seconds", *(key for _, key in EDGE_BYTES), "problem"]
_SECURE_KEYS = ["edges", "survivors", "error_bound", "bytes_up", "bytes_down", "aborted", "refused"]
_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats()
            | st.text(max_size=20))
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=6), inner, max_size=4), max_leaves=16)
_EDGE = st.dictionaries(st.sampled_from(_KEYS), _JSON | st.integers(min_value=0, max_value=2**60), max_size=len(_KEYS))
_TREE = _JSON | st.fixed_dictionaries({}, optional={
    "edges": st.lists(_EDGE | _JSON, max_size=5) | _JSON, "seconds": _JSON, "bytes_devices": _JSON,
    "secure_across_edges": st.dictionaries(st.sampled_from(_SECURE_KEYS), _JSON, max_size=5) | _JSON})


@settings(max_examples=50, deadline=None)
@given(tree=_TREE)
def test_any_json_in_rounds_tree_is_never_a_5xx(site: TestClient, runs: TreeRuns, tree: Any) -> None:
    # Prepare: whatever JSON the store's row holds (NaN, infinities, huge numbers, wrong types, any shape)
    with Session(RunStore(runs.url).engine) as session:
        row = session.get(Round, (runs.junk, 1))
        assert row is not None
        row.tree = tree
        session.commit()
    # Execute
    answers = {url: site.get(url) for url in (f"/runs/{runs.junk}/rounds/1", f"/api/runs/{runs.junk}/rounds/1",
                                                f"/api/runs/{runs.junk}/rounds", f"/runs/{runs.junk}", "/metrics")}
    # Assert: every page, answer and scrape is served, and the API's tree is JSON (an object or null)
    assert {url: r.status_code for url, r in answers.items()} == dict.fromkeys(answers, 200)
    served = answers[f"/api/runs/{runs.junk}/rounds/1"].json()["tree"]
    assert served is None or isinstance(served, dict)
    assert (served is None) == (not isinstance(tree, dict))


def test_a_deployed_edges_name_is_shown_beside_its_number(tmp_path: Any) -> None:
    from dashboard.views import edge_display, tree_edges

    rows = tree_edges({"edges": [{"edge": 1, "name": "edge-b <script>", "sampled": 3}, {"edge": 0, "sampled": 2}]})
    shown = [edge_display(r) for r in rows]
    assert [(s["edge"], s["name"]) for s in shown] == [("1", "edge-b <script>"), ("0", "")]
