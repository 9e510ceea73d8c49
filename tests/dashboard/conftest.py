"""Fixtures for the dashboard tests: a store filled by a real small federation.

``filled_store`` runs ``simulate`` on ``scenarios/quickstart.toml`` (2 rounds, a
fifth of the clients dropping at ``train``) once per session, then adds two
runs through the store API: one with DP and secure-aggregation records, one
whose scenario name and client labels are markup (for the escaping tests).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
from dashboard_support import ROOT, FilledStore, add_dp_run, add_xss_run  # first: puts the repo on the path

from dashboard.app import create_app
from runstore.store import RunStore

with warnings.catch_warnings():  # starlette's import-time deprecations (httpx2, anyio aliases), not ours
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient


def pytest_configure(config: pytest.Config) -> None:
    # Third-party deprecations raised on import (typer -> click 8.3, starlette's TestClient
    # over httpx); the project turns warnings into errors.
    for line in ("ignore:'click\\.utils\\..*' is deprecated:DeprecationWarning",
                 "ignore:Using `httpx` with `starlette.testclient` is deprecated"):
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session")
def filled_store(tmp_path_factory: pytest.TempPathFactory) -> FilledStore:
    from runtimes.simulation import simulate
    from scenarios.schema import load_scenario

    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'quorum.db'}"
    scenario = load_scenario(ROOT / "scenarios" / "quickstart.toml").with_overrides(
        rounds=2, faults={"dropouts": {"train": 0.2}})
    summary = simulate(scenario, db_url=url)
    store = RunStore(url)
    return FilledStore(url=url, sim_run=summary.run_id, dp_run=add_dp_run(store), xss_run=add_xss_run(store))


@pytest.fixture(scope="session")
def client(filled_store: FilledStore) -> Iterator[TestClient]:
    # no token: the dashboard answers loopback Host headers only (TestClient's default is "testserver")
    with TestClient(create_app(filled_store.url), base_url="http://127.0.0.1") as test_client:
        yield test_client
