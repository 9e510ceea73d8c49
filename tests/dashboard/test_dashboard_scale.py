"""10,000 clients: the store writes them a round at a time, and the dashboard pages through them.

A store holds one run of 10,000 clients (100 rounds of 100 sampled clients,
as ``scenarios/scale-10k.toml`` would leave after 100 rounds) and a run of
100. The clients page and ``/api/clients`` answer one page at a time in the
natural order ("2" before "10"); a page over 10,000 clients costs about what
the same page over 100 does (anchor: the small store, timed in the same test).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest
from dashboard_support import state

from core.records import ClientRecord, RoundRecord
from dashboard.app import create_app
from runstore.store import RunStore

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def _store(path: Path, clients: int, per_round: int) -> str:
    url = f"sqlite:///{path}"
    store = RunStore(url)
    run_id = store.create_run(name=f"scale-{clients}", scenario={"name": "scale"}, seed=0, strategy="fedavg",
                              rounds=clients // per_round)
    for n in range(1, clients // per_round + 1):
        sampled = range((n - 1) * per_round, n * per_round)  # every client exactly once
        records = [ClientRecord(client=str(c), outcome="ok" if c % 7 else "dropped", stage=None if c % 7 else "train",
                                num_examples=40) for c in sampled]
        store.commit_round(run_id, RoundRecord(round=n, started_at=float(n), duration_s=0.1, sampled=per_round,
                                               clients=records), state(n))
    store.set_status(run_id, "finished")
    return url


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    folder = tmp_path_factory.mktemp("scale")
    return {n: _store(folder / f"{n}.db", n, 100) for n in (100, 10_000)}


def _timed_get(client: TestClient, url: str, repeats: int = 3) -> tuple[float, object]:
    best, response = float("inf"), None
    for _ in range(repeats):
        started = time.perf_counter()
        response = client.get(url)
        best = min(best, time.perf_counter() - started)
    return best, response


def test_the_api_pages_through_ten_thousand_clients_in_natural_order(stores: dict[int, str]) -> None:
    with TestClient(create_app(stores[10_000]), base_url="http://127.0.0.1") as client:
        # Execute
        first = client.get("/api/clients?limit=100").json()
        last = client.get("/api/clients?limit=100&offset=9950").json()
        whole = client.get("/api/clients").json()
        too_many = client.get("/api/clients?limit=1001")

    # Assert: numeric labels in numeric order, page by page; counts per client from its one round
    assert [c["client"] for c in first] == [str(i) for i in range(100)]
    assert [c["client"] for c in last] == [str(i) for i in range(9950, 10_000)]
    assert len(whole) == 10_000 and [c["client"] for c in whole[:3]] == ["0", "1", "2"]
    assert (first[7]["rounds"], first[7]["dropped"], first[8]["ok"]) == (1, 1, 1)
    assert len(first[8]["recent"]) == 1 and first[8]["recent"][0]["round"] == 1
    assert too_many.status_code == 422


def test_the_clients_page_shows_one_page_and_costs_what_a_small_store_does(stores: dict[int, str]) -> None:
    # Execute: the same page (the last one) over 100 and over 10,000 clients
    timings = {}
    for n, url in stores.items():
        with TestClient(create_app(url), base_url="http://127.0.0.1") as client:
            timings[n], response = _timed_get(client, f"/clients?page={n // 100}")
            assert response.status_code == 200
            html = response.text
            beyond = client.get("/clients?page=999999")  # past the end: the last page

    # Assert: 100 rows, the pager's numbers, and a link to the previous page only
    assert html.count('<tr data-client="') == 100
    assert 'data-client="9999"' in html and 'data-client="9899"' not in html
    assert "Clients 9,901&ndash;10,000 of 10,000" in html and "page 100 of 100" in html
    assert 'href="/clients?page=99"' in html and 'rel="next"' not in html
    assert beyond.status_code == 200 and "page 100 of 100" in beyond.text
    # a page over 10,000 clients is not a page over 10,000 rows: within a small multiple of the 100-client store
    assert timings[10_000] < 5 * timings[100] + 0.5, timings


def test_sql_order_is_the_natural_order(tmp_path: Path) -> None:
    # Prepare: numbers with and without leading zeros, names, the empty label
    from dashboard.queries import Reader, natural_key

    url = f"sqlite:///{tmp_path / 'order.db'}"
    store = RunStore(url)
    run_id = store.create_run(name="order", scenario={"name": "order"}, seed=0, strategy="fedavg", rounds=1)
    labels = ["10", "2", "007", "b", "a", "", "1", "zeta", "100"]
    store.commit_round(run_id, RoundRecord(round=1, started_at=1.0, duration_s=0.1, sampled=len(labels),
                                           clients=[ClientRecord(client=c, outcome="ok") for c in labels]), state(1))

    # Execute
    listed = [c.client for c in Reader(url).clients(None, limit=100)]
    paged = [c.client for o in range(0, len(labels), 4) for c in Reader(url).clients(None, limit=4, offset=o)]

    # Assert: what the Python sort key gives, page by page too
    assert listed == sorted(labels, key=natural_key) == ["1", "2", "007", "10", "100", "", "a", "b", "zeta"]
    assert paged == listed
