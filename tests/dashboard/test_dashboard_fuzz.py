"""The dashboard against hostile query and path values: a 2xx or a declared 4xx, never a 500.

Every integer a request carries is bound before it reaches SQLite (which
cannot bind one of 2**63 or more); the OpenAPI document is fuzzed through
schemathesis: no 5xx, and every status code a route answers is declared.
"""

from __future__ import annotations

from urllib.parse import quote

import pytest
import schemathesis
from dashboard_support import FilledStore, state
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.records import ClientRecord, RoundRecord
from dashboard.app import create_app
from runstore.store import RunStore

LOOPBACK = {"host": "127.0.0.1"}  # without a token the dashboard answers loopback Host headers only
HUGE = [2**63, 2**64, 10**30, -(2**63) - 1]


def _routes(run_id: str, value: int | str) -> list[str]:
    n = quote(str(value), safe="")  # any text, percent-encoded as a browser would send it
    return [f"/api/runs?offset={n}", f"/api/runs?limit={n}", f"/api/runs/{run_id}/rounds/{n}",
            f"/api/runs/{run_id}/rounds/{n}/clients", f"/api/runs/{run_id}/rounds?after={n}",
            f"/api/runs/{run_id}/checkpoint?round={n}", f"/runs/{run_id}/rounds/{n}", f"/?page={n}",
            f"/?per_page={n}", f"/api/clients?limit={n}", f"/api/clients?offset={n}", f"/clients?page={n}"]


@pytest.mark.parametrize("number", HUGE)
def test_integers_beyond_64_bits_are_a_4xx_on_every_route(client: TestClient, filled_store: FilledStore,
                                                         number: int) -> None:
    # once an OverflowError (500) from SQLite on each of these
    for url in _routes(filled_store.sim_run, number):
        response = client.get(url)
        assert 400 <= response.status_code < 500, (url, response.status_code)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(number=st.one_of(st.integers(), st.integers(min_value=2**62, max_value=2**80),
                        st.text(max_size=12), st.sampled_from(["nan", "inf", "-0", "1e9", "0x10", " 1", ""])))
def test_any_number_or_string_in_a_query_or_path_is_never_a_500(client: TestClient, filled_store: FilledStore,
                                                                 number: int | str) -> None:
    for url in _routes(filled_store.sim_run, number):
        response = client.get(url)
        assert response.status_code < 500, (url, response.status_code)


def test_example_counts_of_2_62_in_the_store_keep_the_clients_pages_up(db_url: str) -> None:
    # Prepare: two rows claiming 2**62 examples (their SUM once overflowed SQLite: /api/clients answered 500)
    store = RunStore(db_url)
    run_id = store.create_run(name="big", scenario={}, seed=0, strategy="fedavg", rounds=2)
    for n in (1, 2):
        record = RoundRecord(round=n, started_at=1.0, duration_s=1.0, sampled=1,
                             clients=[ClientRecord(client="7", outcome="ok", num_examples=2**62)])
        store.commit_round(run_id, record, state(n))
    # Execute
    with TestClient(create_app(db_url), base_url="http://127.0.0.1") as client:
        api, page = client.get("/api/clients"), client.get("/clients")
    # Assert: the store bounded each count to 10**9
    assert (api.status_code, page.status_code) == (200, 200)
    assert api.json()[0]["examples"] == 2 * 10**9


def test_openapi_fuzz_no_5xx_and_every_status_declared(filled_store: FilledStore) -> None:
    # Prepare: every operation of /openapi.json, but the live streams (they end only with their run)
    app = create_app(filled_store.url)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=LOOPBACK).exclude(path_regex=r"/events$")
    operations = [result.ok() for result in schema.get_all_operations()]
    failures = []
    # Execute: schemathesis draws requests from each operation's declared parameters
    for operation in operations:
        @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def call(case) -> None:
            case.call_and_validate(headers=LOOPBACK, checks=[schemathesis.checks.not_a_server_error,
                                                             schemathesis.checks.status_code_conformance])
        try:
            call()
        except Exception as exc:  # collected: one report naming every operation that failed
            failures.append(f"{operation.label}: {exc}")
    # Assert
    assert len(operations) >= 10
    assert failures == []


def test_non_finite_round_figures_are_stored_as_null_and_served(db_url: str) -> None:
    # Prepare: a diverged server evaluation (inf loss) and a NaN training loss
    store = RunStore(db_url)
    run_id = store.create_run(name="diverged", scenario={}, seed=0, strategy="fedavg", rounds=1)
    store.commit_round(run_id, RoundRecord(round=1, started_at=1.0, duration_s=1.0, sampled=0, clients=[],
                                           train_loss=float("nan"), server_loss=float("inf"),
                                           server_accuracy=0.1), state(1))
    # Execute
    with TestClient(create_app(db_url), base_url="http://127.0.0.1") as client:
        response = client.get(f"/api/runs/{run_id}/rounds")
    # Assert: JSON has no Infinity; the unknowable figures are null
    assert response.status_code == 200
    (row,) = response.json()
    assert (row["train_loss"], row["server_loss"], row["server_accuracy"]) == (None, None, 0.1)
