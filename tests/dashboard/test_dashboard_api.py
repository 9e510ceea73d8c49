"""The JSON API, downloads, live stream and metrics over a store filled by a real federation."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dashboard_support import FilledStore, state
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from core.records import ClientRecord, RoundRecord
from dashboard.app import create_app
from dashboard.live import runs_events
from dashboard.queries import Reader, RunHead
from runstore.store import Round, RunStore
from tests.conftest import wait_for


def _accuracy(row: Round) -> float | None:
    return row.server_accuracy if row.server_accuracy is not None else row.fed_accuracy


def test_runs_lists_every_run_with_best_accuracy(client: TestClient, filled_store: FilledStore) -> None:
    # Prepare
    rounds = RunStore(filled_store.url).rounds(filled_store.sim_run)
    # Execute
    runs = {r["id"]: r for r in client.get("/api/runs").json()}
    # Assert
    assert set(runs) == {filled_store.sim_run, filled_store.dp_run, filled_store.xss_run}
    sim = runs[filled_store.sim_run]
    assert (sim["name"], sim["status"], sim["rounds_done"], sim["rounds_total"]) == ("quickstart", "finished", 2, 2)
    assert sim["best_accuracy"] == max(_accuracy(r) for r in rounds)
    assert sim["last_accuracy"] == _accuracy(rounds[-1])
    assert runs[filled_store.dp_run]["best_accuracy"] == 0.7  # fed accuracies 0.6, 0.7 by hand
    assert runs[filled_store.dp_run]["epsilon"] == 0.75


def test_runs_filter_by_status(client: TestClient, filled_store: FilledStore) -> None:
    assert [r["id"] for r in client.get("/api/runs?status=stopped_budget").json()] == [filled_store.dp_run]
    assert client.get("/api/runs?status=running").json() == []


def test_runs_page_through_with_limit_and_offset(client: TestClient) -> None:
    # Prepare: the whole list, newest first
    whole = [r["id"] for r in client.get("/api/runs").json()]
    started = [r["started_at"] for r in client.get("/api/runs").json()]
    # Execute
    pages = [[r["id"] for r in client.get(f"/api/runs?limit=2&offset={offset}").json()] for offset in (0, 2, 4)]
    # Assert: consecutive slices of the whole list, and bad bounds named
    assert started == sorted(started, reverse=True) and len(whole) == 3
    assert pages == [whole[:2], whole[2:], []]
    assert [r["id"] for r in client.get("/api/runs?offset=1").json()] == whole[1:]
    bad = client.get("/api/runs?limit=0")
    assert bad.status_code == 422 and "limit" in bad.text


def test_run_detail_has_the_scenario_as_submitted(client: TestClient, filled_store: FilledStore) -> None:
    stored = RunStore(filled_store.url).get_run(filled_store.sim_run)
    body = client.get(f"/api/runs/{filled_store.sim_run}").json()
    assert body["scenario"] == stored.scenario
    assert body["scenario"]["faults"]["dropouts"] == {"train": 0.2}
    assert client.get("/api/runs/no-such-run").status_code == 404


def test_rounds_match_the_store(client: TestClient, filled_store: FilledStore) -> None:
    stored = RunStore(filled_store.url).rounds(filled_store.sim_run)
    rounds = client.get(f"/api/runs/{filled_store.sim_run}/rounds").json()
    assert [r["round"] for r in rounds] == [1, 2]
    for got, row in zip(rounds, stored, strict=True):
        assert (got["sampled"], got["answered"], got["dropped"]) == (row.sampled, row.answered, row.dropped)
        assert got["server_accuracy"] == row.server_accuracy and got["fed_loss"] == row.fed_loss
        assert got["answered"] + got["dropped"] + got["rejected"] == got["sampled"] == 10  # 20 clients x 0.5
    assert client.get(f"/api/runs/{filled_store.sim_run}/rounds?after=1").json()[0]["round"] == 2


def test_round_clients_show_each_outcome(client: TestClient, filled_store: FilledStore) -> None:
    clients = client.get(f"/api/runs/{filled_store.sim_run}/rounds/1/clients").json()
    round_ = client.get(f"/api/runs/{filled_store.sim_run}/rounds/1").json()
    assert len(clients) == round_["sampled"]
    ok = [c for c in clients if c["outcome"] == "ok"]
    dropped = [c for c in clients if c["outcome"] == "dropped"]
    assert len(ok) == round_["answered"] and len(dropped) == round_["dropped"]
    assert all(c["num_examples"] > 0 and c["train_loss"] is not None for c in ok)
    assert all(c["description"].startswith("dropped at train") for c in dropped)
    # each client's bytes each way, as the wire carried them; the round's are their sums
    assert sum(c["bytes_in"] for c in clients) == round_["bytes_in"] > 0
    assert sum(c["bytes_out"] for c in clients) == round_["bytes_out"] > 0
    assert client.get(f"/api/runs/{filled_store.sim_run}/rounds/9/clients").status_code == 404


def test_clients_sum_to_the_client_results(client: TestClient, filled_store: FilledStore) -> None:
    results = RunStore(filled_store.url).client_results(filled_store.sim_run)
    clients = client.get(f"/api/clients?run={filled_store.sim_run}").json()
    assert sum(c["rounds"] for c in clients) == len(results) == 20  # 10 sampled in each of 2 rounds
    assert sum(c["ok"] for c in clients) == sum(1 for r in results if r.outcome == "ok")
    first = clients[0]
    history = client.get(f"/api/clients/{first['client']}?run={filled_store.sim_run}").json()
    assert len(history) == first["rounds"]
    assert max(h["finished_at"] for h in history) == first["last_seen"]
    assert client.get("/api/clients/nobody").status_code == 404


def test_clients_are_sorted_numerically(client: TestClient, filled_store: FilledStore) -> None:
    labels = [c["client"] for c in client.get(f"/api/clients?run={filled_store.sim_run}").json()]
    assert labels == sorted(labels, key=int)


def test_metrics_csv_has_one_line_per_round(client: TestClient, filled_store: FilledStore) -> None:
    response = client.get(f"/api/runs/{filled_store.sim_run}/metrics.csv")
    rows = list(csv.DictReader(io.StringIO(response.text)))
    assert response.headers["content-type"].startswith("text/csv")
    assert f'filename="{filled_store.sim_run}-rounds.csv"' in response.headers["content-disposition"]
    assert [int(r["round"]) for r in rows] == [1, 2]
    stored = RunStore(filled_store.url).rounds(filled_store.sim_run)
    assert float(rows[1]["server_accuracy"]) == stored[1].server_accuracy


def test_checkpoint_download_is_the_last_rounds_file(client: TestClient, filled_store: FilledStore) -> None:
    last = RunStore(filled_store.url).rounds(filled_store.sim_run)[-1]
    response = client.get(f"/api/runs/{filled_store.sim_run}/checkpoint")
    assert response.status_code == 200
    assert response.content == Path(last.checkpoint).read_bytes()
    assert "round-00002.safetensors" in response.headers["content-disposition"]
    assert client.get(f"/api/runs/{filled_store.sim_run}/checkpoint?round=7").status_code == 404


def _sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if "event" in fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def test_event_stream_of_a_finished_run_sends_the_rest_and_ends(client: TestClient,
                                                                 filled_store: FilledStore) -> None:
    response = client.get(f"/api/runs/{filled_store.sim_run}/events?after=1")
    events = _sse(response.text)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert [name for name, _ in events] == ["round", "run"]
    assert events[0][1]["round"]["round"] == 2 and events[0][1]["display"]["clients"].endswith("/ 10")
    assert events[1][1]["run"]["status"] == "finished"


def test_event_stream_pushes_a_round_committed_while_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a running run in a store of its own; a writer commits round 1 once the stream has
    # polled the store, and finishes the run once the stream has seen round 1 (finishing always,
    # so a failed wait cannot leave the stream open)
    url = f"sqlite:///{tmp_path / 'live.db'}"
    store = RunStore(url)
    run_id = store.create_run(name="live", scenario={"name": "live"}, seed=0, strategy="fedavg", rounds=1)
    app = create_app(url)
    heads: list[RunHead | None] = []
    head = app.state.reader.head

    def spy(rid: str) -> RunHead | None:
        heads.append(head(rid))
        return heads[-1]

    monkeypatch.setattr(app.state.reader, "head", spy)

    def write() -> None:
        try:
            wait_for(lambda: heads, 10, "the stream's first poll of the store")
            record = RoundRecord(round=1, started_at=time.time(), duration_s=0.1, sampled=1,
                                 clients=[ClientRecord(client="1", outcome="ok", num_examples=5)], fed_accuracy=0.25)
            store.commit_round(run_id, record, state(1))
            wait_for(lambda: any(h is not None and h.last_round >= 1 for h in heads), 10, "the stream to see round 1")
        finally:
            store.set_status(run_id, "finished")

    # Execute
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        writer = pool.submit(write)
        with TestClient(app, base_url="http://127.0.0.1") as client, \
                client.stream("GET", f"/api/runs/{run_id}/events") as response:
            text = "".join(response.iter_text())
        writer.result(timeout=30)
    # Assert
    events = _sse(text)
    rounds = [data["round"]["fed_accuracy"] for name, data in events if name == "round"]
    statuses = [data["run"]["status"] for name, data in events if name == "run"]
    assert rounds == [0.25]
    assert statuses[0] == "running" and statuses[-1] == "finished"
    assert "id: 1" in text
    assert time.monotonic() - started < 5


def test_prometheus_metrics_per_run(client: TestClient, filled_store: FilledStore) -> None:
    response = client.get("/metrics")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}
    rounds = RunStore(filled_store.url).rounds(filled_store.sim_run)
    run = (("run", filled_store.sim_run),)
    assert samples[("quorum_run_rounds_completed_total", run)] == 2
    assert samples[("quorum_run_clients_answered_total", run)] == sum(r.answered for r in rounds)
    assert samples[("quorum_run_clients_dropped_total", run)] == sum(r.dropped for r in rounds)
    assert samples[("quorum_run_round_duration_seconds_count", run)] == 2
    assert abs(samples[("quorum_run_round_duration_seconds_sum", run)] - sum(r.duration_s for r in rounds)) < 1e-9
    assert samples[("quorum_run_epsilon", (("run", filled_store.dp_run),))] == 0.75
    assert ("quorum_run_epsilon", run) not in samples  # no DP, no epsilon series
    finished = len(client.get("/api/runs?status=finished").json())
    assert samples[("quorum_runs", (("status", "finished"),))] == finished >= 1


def test_openapi_documents_the_api(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for path in ("/api/runs", "/api/runs/{run_id}", "/api/runs/{run_id}/rounds",
                 "/api/runs/{run_id}/rounds/{number}/clients", "/api/clients", "/api/runs/{run_id}/events",
                 "/metrics"):
        assert path in paths
    assert "/runs/{run_id}" not in paths  # pages are not API
    assert "/api/runs/{run_id}/events" in client.get("/docs").text


def test_plotly_is_served_from_the_installed_package(client: TestClient) -> None:
    from dashboard.app import plotly_dir

    response = client.get("/static/vendor/plotly/plotly.min.js")
    assert response.status_code == 200
    assert response.content == (plotly_dir() / "plotly.min.js").read_bytes()


def test_runs_stream_follows_changes_with_the_status_counts(tmp_path: Path) -> None:
    # Prepare: a finished run, then a running one; the stream starts before both
    url = f"sqlite:///{tmp_path / 'counts.db'}"
    store = RunStore(url)
    done = store.create_run(name="done", scenario={"name": "done"}, seed=0, strategy="fedavg", rounds=1)
    store.set_status(done, "finished")
    live = store.create_run(name="live", scenario={"name": "live"}, seed=0, strategy="fedavg", rounds=3)

    async def first(count: int) -> list:
        stream = runs_events(Reader(url), since=0.0, poll_s=0.05)
        try:
            return [await anext(stream) for _ in range(count)]
        finally:
            await stream.aclose()

    # Execute
    events = asyncio.run(first(3))
    # Assert: each run once, then the counts a chip row shows (2 in all: 1 finished, 1 running)
    assert [e.event for e in events] == ["run", "run", "counts"]
    assert {e.data["run"]["id"]: e.data["run"]["status"] for e in events[:2]} == {done: "finished",
                                                                                   live: "running"}
    assert events[2].data == {"counts": {"finished": 1, "running": 1}, "total": 2}


def test_failed_clients_are_counted_apart_on_the_api_the_pages_and_metrics(tmp_path: Path) -> None:
    # Prepare: one round in which a client answered, one dropped, one's reply was refused, one's task raised
    url = f"sqlite:///{tmp_path / 'failed.db'}"
    store = RunStore(url)
    run_id = store.create_run(name="mixed", scenario={"name": "mixed"}, seed=0, strategy="fedavg", rounds=1)
    clients = [ClientRecord("1", "ok", num_examples=5), ClientRecord("2", "dropped", stage="train"),
               ClientRecord("3", "rejected", stage="train", reason="update holds NaN or Inf values"),
               ClientRecord("4", "failed", stage="train", reason="DataError: no label column 'label'")]
    store.commit_round(run_id, RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=4, clients=clients),
                       state(1))

    # Execute
    with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
        round_ = client.get(f"/api/runs/{run_id}/rounds/1").json()
        by_client = {c["client"]: c for c in client.get("/api/clients").json()}
        page = client.get(f"/runs/{run_id}/rounds/1").text
        metrics = client.get("/metrics").text

    # Assert: one count per outcome, each on the API, the round page and /metrics
    assert [round_[k] for k in ("answered", "dropped", "rejected", "failed")] == [1, 1, 1, 1]
    assert [(by_client[c]["rejected"], by_client[c]["failed"]) for c in "34"] == [(1, 0), (0, 1)]
    assert "Failed" in page and "failed at train: DataError: no label column &#39;label&#39;" in page
    samples = {(s.name, s.labels.get("run")): s.value for family in text_string_to_metric_families(metrics)
               for s in family.samples}
    assert samples[("quorum_run_clients_failed_total", run_id)] == 1
    assert samples[("quorum_run_clients_rejected_total", run_id)] == 1
