"""A run whose process died reads ``interrupted`` on the dashboard, with when it was last seen (issue 32, item 2).

The dead run's lease is dated by an injected clock in the past: nothing waits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dashboard.app import create_app
from dashboard.live import runs_events
from dashboard.queries import Reader, changed_at
from runstore.lease import LEASE_S
from runstore.store import RunStore

LAST_SEEN = 1_700_000_000.0  # the dead run's process was last seen then (2023-11-14)


@dataclass(frozen=True)
class Runs:
    url: str
    dead: str
    live: str
    done: str


@pytest.fixture
def runs(tmp_path: Path) -> Runs:
    """Three runs: one whose process died long ago (its lease expired), one running, one finished."""
    url = f"sqlite:///{tmp_path / 'lease.db'}"
    dead = RunStore(url, clock=lambda: LAST_SEEN).create_run(name="dead", scenario={"name": "dead"}, seed=0,
                                                             strategy="fedavg", rounds=50)
    store = RunStore(url)
    live = store.create_run(name="live", scenario={"name": "live"}, seed=0, strategy="fedavg", rounds=5)
    done = store.create_run(name="done", scenario={"name": "done"}, seed=0, strategy="fedavg", rounds=1)
    store.set_status(done, "finished")
    return Runs(url, dead, live, done)


@pytest.fixture
def client(runs: Runs) -> Iterator[TestClient]:
    with TestClient(create_app(runs.url), base_url="http://127.0.0.1") as test_client:
        yield test_client


def test_the_api_shows_a_dead_run_interrupted_with_when_it_was_last_seen(client: TestClient, runs: Runs) -> None:
    listed = {r["id"]: r for r in client.get("/api/runs").json()}
    detail = client.get(f"/api/runs/{runs.dead}").json()

    assert {k: r["status"] for k, r in listed.items()} == {runs.dead: "interrupted", runs.live: "running",
                                                           runs.done: "finished"}
    assert listed[runs.dead]["last_seen"] == detail["last_seen"] == LAST_SEEN
    assert detail["status"] == "interrupted"
    assert listed[runs.dead]["duration_s"] == 0.0  # it ended when last seen, not now
    assert [r["id"] for r in client.get("/api/runs?status=interrupted").json()] == [runs.dead]
    assert [r["id"] for r in client.get("/api/runs?status=running").json()] == [runs.live]


def test_the_pages_and_metrics_count_it_interrupted(client: TestClient, runs: Runs) -> None:
    page = client.get("/").text
    run_page = client.get(f"/runs/{runs.dead}").text
    metrics = {s.labels["status"]: s.value for family in text_string_to_metric_families(client.get("/metrics").text)
               for s in family.samples if s.name == "quorum_runs"}

    assert 'data-count-of="interrupted">1<' in page and 'data-count-of="running">1<' in page
    assert f"last seen <span data-field=\"last_seen\">{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(LAST_SEEN))}" \
           in page
    assert 'class="badge status-interrupted"' in run_page and f"<code>quorum resume {runs.dead}</code>" in run_page
    assert (metrics["interrupted"], metrics["running"], metrics["finished"]) == (1, 1, 1)


def test_the_live_stream_reports_a_lease_that_expires_once(runs: Runs) -> None:
    # Prepare: a reader whose clock has moved past the live run's lease
    reader = Reader(runs.url)
    since = time.time()
    reader.store.clock = lambda: since + 2 * LEASE_S

    async def first_two() -> list:
        stream = runs_events(reader, since=since, poll_s=0.01)
        try:
            return [await anext(stream) for _ in range(2)]
        finally:
            await stream.aclose()

    # Execute
    events = asyncio.run(first_two())
    # Assert: the run now reads interrupted, announced once (the next poll finds nothing new)
    assert [e.event for e in events] == ["run", "counts"]
    assert (events[0].data["run"]["id"], events[0].data["run"]["status"]) == (runs.live, "interrupted")
    assert events[1].data["counts"] == {"interrupted": 2, "finished": 1}
    (changed, _), = reader.changed_runs(since)
    assert reader.changed_runs(changed_at(changed)) == []
