"""A task judged by its own metric: a Cox model's C-index on every surface (issue 33, item 3).

One federation of the survival task (``tests/learning/survival_task.py``: six
hospitals with their own test rows, a linear Cox model, Harrell's C-index as
``headline_metric``) runs in this process through ``quorum simulate``, once as
a person reads it and once with ``--json``; each test then reads one surface
back: the round lines and the summary, the JSON, ``quorum runs``, the HTTP API
and the pages, the metrics CSV, ``/metrics``, ``quorum report``'s files, and
the store's per-client C-index, whose example-weighted mean must be the
round's federated value.
"""

from __future__ import annotations

import csv
import io
import json
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from core.headline import headline_of, parse_headline
from core.records import ClientRecord, RoundRecord
from core.strategy import ServerState
from learning.task import task_headline
from learning.tasks.classification import ClassificationTask
from learning.tasks.language import LanguageModelTask
from learning.tasks.regression import RegressionTask
from runstore.store import RunStore
from scenarios.errors import ScenarioError
from tests.learning.survival_task import BETA, HOSPITALS, SurvivalTask, c_index, hospital

with warnings.catch_warnings():  # starlette's import-time deprecations (httpx2, anyio aliases), not ours
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient` is deprecated")

SEED = 7
SCENARIO = f"""
name = "survival"
seed = {SEED}
rounds = 3
[federation]
clients = 6
min_clients = 6
[training]
lr = 0.5
[task]
entry = "tests.learning.survival_task:SurvivalTask"
steps = 10
"""


@dataclass(frozen=True)
class Federation:
    db: str
    folder: Path
    text_run: str  # the run simulated for a person (round lines on stderr)
    text: str  # its stdout and stderr, whitespace folded (rich wraps at the console's width)
    json_run: dict  # the --json summary of a second, identical run


def cli(*args: str) -> tuple[str, str]:
    from quorum.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout, result.stderr


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Federation:
    folder = tmp_path_factory.mktemp("survival")
    scenario = folder / "survival.toml"
    scenario.write_text(SCENARIO)
    db = f"sqlite:///{folder / 'runs.db'}"
    out, err = cli("simulate", str(scenario), "--db", db, "--workers", "1")
    started = re.search(r"run (\S+) started", err)
    assert started, err
    as_json, _ = cli("simulate", str(scenario), "--db", db, "--workers", "1", "--json")
    return Federation(db, folder, started.group(1), " ".join((err + " " + out).split()), json.loads(as_json))


@pytest.fixture(scope="module")
def api(federation: Federation) -> Iterator[TestClient]:
    from dashboard.app import create_app

    with TestClient(create_app(federation.db), base_url="http://127.0.0.1") as client:
        yield client


def fed_c_index(store: RunStore, run_id: str, server_round: int) -> float:
    """The round's federated C-index as the round loop stored it."""
    value = store.rounds(run_id)[server_round - 1].metrics["fed-c_index"]
    assert isinstance(value, float)
    return value


# -- the task and its declaration ---------------------------------------------------------------------


def test_harrells_c_index_by_hand() -> None:
    time, event = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1, 0, 1, 1])
    # comparable pairs (the shorter time an event): (0,1) (0,2) (0,3) (2,3); concordant: the earlier is riskier
    assert c_index(np.array([4.0, 3.0, 2.0, 1.0]), time, event) == 1.0
    assert c_index(np.array([1.0, 2.0, 3.0, 4.0]), time, event) == 0.0
    assert c_index(np.array([4.0, 3.0, 1.0, 2.0]), time, event) == 0.75  # (2,3) discordant
    assert c_index(np.zeros(4), time, event) == 0.5  # all ties: one half each
    assert c_index(np.ones(2), np.array([1.0, 2.0]), np.array([0, 0])) == 0.5  # nothing comparable


def test_hospitals_hold_their_own_rows_and_the_true_coefficients_rank_them() -> None:
    for i, (n_train, n_test, _) in enumerate(HOSPITALS):
        rows = hospital(i, SEED)
        assert (len(rows.train), len(rows.test)) == (n_train, n_test)
        assert c_index(rows.test.x @ BETA, rows.test.time, rows.test.event) > 0.65
    assert not np.array_equal(hospital(0, SEED).test.x, hospital(1, SEED).test.x)


def test_tasks_declare_their_headline_metric_and_direction() -> None:
    declared = {cls.__name__: headline_of(cls) for cls in (SurvivalTask, ClassificationTask, RegressionTask,
                                                           LanguageModelTask)}
    assert {name: (h.name, h.direction) for name, h in declared.items()} == {
        "SurvivalTask": ("c_index", "up"), "ClassificationTask": ("accuracy", "up"),
        "RegressionTask": ("mae", "down"), "LanguageModelTask": ("perplexity", "down")}
    # a bare name: losses and errors go down, anything else up; a task declaring nothing is judged by accuracy
    assert [parse_headline(n).direction for n in ("rmse", "val_loss", "auc")] == ["down", "down", "up"]
    assert headline_of(object()) == parse_headline(("accuracy", "up"))


@pytest.mark.parametrize("declared", ["", ("c_index", "sideways"), 3, ("a", "up", "b")])
def test_a_malformed_declaration_is_refused_naming_the_task(declared: object) -> None:
    task = type("Bad", (SurvivalTask,), {"headline_metric": declared})
    with pytest.raises(ScenarioError, match=r"s\.toml: task\.entry = 'm:Bad': headline_metric = "):
        task_headline(task, "s.toml", "m:Bad")


# -- the surfaces ---------------------------------------------------------------------------------------


def test_round_lines_and_summary_name_the_c_index(federation: Federation) -> None:
    lines = re.findall(r"round +(\d) +loss \S+ +c_index (0\.\d+)", federation.text)
    assert [int(n) for n, _ in lines] == [1, 2, 3], federation.text
    store = RunStore(federation.db)
    assert [float(v) for _, v in lines] == pytest.approx(
        [fed_c_index(store, federation.text_run, n) for n in (1, 2, 3)], abs=1e-4)
    assert all(float(v) > 0.65 for _, v in lines)
    assert "acc -" not in federation.text and "accuracy" not in federation.text
    assert f"3 rounds, c_index {fed_c_index(store, federation.text_run, 3):.4g}" in federation.text


def test_json_carries_the_headline_metric_and_every_final_score(federation: Federation) -> None:
    summary = federation.json_run
    store = RunStore(federation.db)
    run_id = summary["run_id"]
    assert summary["metric"]["name"] == "c_index" and summary["metric"]["direction"] == "up"
    assert summary["metric"]["split"] == "federated"
    assert summary["metric"]["final"] == pytest.approx(fed_c_index(store, run_id, 3))
    assert summary["metric"]["best"] == pytest.approx(max(fed_c_index(store, run_id, n) for n in (1, 2, 3)))
    assert set(summary["final_scores"]["federated"]) == {"c_index", "loss"}
    assert summary["final_accuracy"] is None


def test_quorum_runs_shows_the_best_c_index_of_each_run(federation: Federation) -> None:
    out, _ = cli("runs", "--db", federation.db)
    store = RunStore(federation.db)
    assert "best c_index" in out and "acc" not in out
    for run in store.list_runs():
        assert f"{max(fed_c_index(store, run.id, n) for n in (1, 2, 3)):.4g}" in out


def test_quorum_runs_names_each_metric_when_the_runs_mix_tasks(tmp_path: Path, federation: Federation) -> None:
    # Prepare: a copy of the store plus a classification run (no headline recorded: accuracy) with two rounds
    db = f"sqlite:///{tmp_path / 'mixed.db'}"
    store, source = RunStore(db), RunStore(federation.db)
    run = source.get_run(federation.text_run)
    copied = store.create_run(name=run.name, scenario=run.scenario, seed=run.seed, strategy=run.strategy,
                              rounds=3, info=run.info)
    for r in source.rounds(run.id):
        store.commit_round(copied, RoundRecord(round=r.round, started_at=r.started_at, duration_s=r.duration_s,
                                               sampled=r.sampled, clients=[], metrics=r.metrics),
                           ServerState(params=np.zeros(6, np.float32), round=r.round))
    digits = store.create_run(name="digits", scenario={}, seed=1, strategy="fedavg", rounds=2)
    for n, accuracy in ((1, 0.5), (2, 0.8125)):
        store.commit_round(digits, RoundRecord(round=n, started_at=0.0, duration_s=1.0, sampled=1,
                                               clients=[ClientRecord("1", "ok")], server_accuracy=accuracy),
                           ServerState(params=np.zeros(2, np.float32), round=n))

    # Execute
    out, _ = cli("runs", "--db", db)

    # Assert: one "best" column, each value with its metric's name
    best = max(fed_c_index(source, run.id, n) for n in (1, 2, 3))
    assert "best c_index" not in out and "best acc" not in out
    assert f"c_index {best:.4g}" in out and "accuracy 81.25%" in out


def test_api_run_rounds_and_clients_carry_the_c_index(federation: Federation, api: TestClient) -> None:
    run_id = federation.text_run
    store = RunStore(federation.db)
    run = api.get(f"/api/runs/{run_id}").json()
    assert run["metric"] == {"name": "c_index", "direction": "up"} and run["info"]["headline"] == run["metric"]
    assert run["last_metric"] == pytest.approx(fed_c_index(store, run_id, 3))
    assert run["best_metric"] == pytest.approx(max(fed_c_index(store, run_id, n) for n in (1, 2, 3)))
    assert run["best_accuracy"] is None
    for n in (1, 2, 3):
        served = api.get(f"/api/runs/{run_id}/rounds/{n}").json()
        assert served["metric"] == served["scores"]["federated"]["c_index"] == pytest.approx(
            fed_c_index(store, run_id, n))
    clients = api.get(f"/api/runs/{run_id}/rounds/3/clients").json()
    stored = {c.client: c.metrics["eval-c_index"] for c in store.client_results(run_id, 3)}
    assert {c["client"]: c["eval_metrics"]["c_index"] for c in clients} == pytest.approx(stored)
    history = api.get("/api/clients/4", params={"run": run_id}).json()
    assert sorted(h["round"] for h in history if "c_index" in h["eval_metrics"]) == [1, 2, 3]


def test_pages_show_the_c_index_and_no_accuracy(federation: Federation, api: TestClient) -> None:
    run_id = federation.text_run
    store = RunStore(federation.db)
    last = f"{fed_c_index(store, run_id, 3):.4g}"
    runs = api.get("/").text
    assert "Best c_index" in runs and "Best accuracy" not in runs and last in runs
    page = api.get(f"/runs/{run_id}").text
    assert "Best c_index" in page and "Fed. c_index" in page and 'id="chart-accuracy"' in page
    assert "Accuracy" not in page and "acc." not in page
    round_page = api.get(f"/runs/{run_id}/rounds/3").text
    assert "Federated c_index" in round_page and "Eval c_index" in round_page and 'id="scores-table"' in round_page
    for c in store.client_results(run_id, 3):  # each hospital's own value, in its row
        row = re.search(rf'<tr data-client="{c.client}">.*?</tr>', round_page, re.S)
        assert row and f"{c.metrics['eval-c_index']:.4g}" in row.group(0)


def test_metrics_csv_has_the_c_index_under_its_name(federation: Federation, api: TestClient) -> None:
    run_id = federation.text_run
    response = api.get(f"/api/runs/{run_id}/metrics.csv")
    assert response.status_code == 200
    rows = list(csv.DictReader(io.StringIO(response.text)))
    expected = [fed_c_index(RunStore(federation.db), run_id, n) for n in (1, 2, 3)]
    assert [float(r["c_index"]) for r in rows] == pytest.approx(expected)
    assert [float(r["fed-c_index"]) for r in rows] == pytest.approx(expected)


def test_prometheus_metrics_carry_the_c_index_by_name(federation: Federation, api: TestClient) -> None:
    text = api.get("/metrics").text
    store = RunStore(federation.db)
    run = f'run="{federation.text_run}"'
    series = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if run in line and 'metric="c_index"' in line}
    assert series["quorum_run_metric"] == pytest.approx(fed_c_index(store, federation.text_run, 3))
    assert series["quorum_run_best_metric"] == pytest.approx(
        max(fed_c_index(store, federation.text_run, n) for n in (1, 2, 3)))
    assert series["quorum_run_task_metric"] == pytest.approx(fed_c_index(store, federation.text_run, 3))
    assert f'quorum_run_task_metric{{metric="loss",run="{federation.text_run}",split="federated"}}' in text


def test_report_plots_the_c_index_and_lists_it_per_client(federation: Federation) -> None:
    out_dir = federation.folder / "report"
    cli("report", federation.text_run, "--db", federation.db, "--out", str(out_dir))
    names = {p.name for p in out_dir.iterdir()}
    assert {"summary.json", "c_index_loss.png", "c_index_bytes.png", "clients.csv", "clients_c_index.png"} <= names
    assert not any(name.startswith("accuracy") for name in names)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["metric"]["name"] == "c_index"
    assert [r["metric"] for r in summary["rounds"]] == pytest.approx(
        [fed_c_index(RunStore(federation.db), federation.text_run, n) for n in (1, 2, 3)])
    with (out_dir / "clients.csv").open(encoding="utf-8") as handle:
        rows = [r for r in csv.DictReader(handle) if r["round"] == "3"]
    assert sorted(r["client"] for r in rows) == ["1", "2", "3", "4", "5", "6"]
    assert all(0.5 < float(r["c_index"]) <= 1.0 for r in rows)


def test_each_hospitals_c_index_is_stored_and_their_weighted_mean_is_the_rounds(federation: Federation) -> None:
    store = RunStore(federation.db)
    run_id = federation.text_run
    for server_round in (1, 2, 3):
        results = store.client_results(run_id, server_round)
        per_client = {int(r.client): (r.metrics["eval-c_index"], r.metrics["eval-examples"]) for r in results}
        # six hospitals, each scored on its own test rows (client k holds partition k - 1)
        assert {k: n for k, (_, n) in per_client.items()} == {k + 1: HOSPITALS[k][1] for k in range(6)}
        values = np.array([per_client[k][0] for k in range(1, 7)])
        sizes = np.array([per_client[k][1] for k in range(1, 7)], dtype=np.float64)
        assert len(set(values.round(9))) == 6  # six values of their own, not the mean copied six times
        assert float(values @ sizes / sizes.sum()) == pytest.approx(fed_c_index(store, run_id, server_round))
    # the last round's values, recomputed here from the stored model (the linear layer's beta) and the rows
    state = store.load_state(run_id, 3)
    assert state is not None
    beta = np.asarray(state.params, dtype=np.float64)
    for r in store.client_results(run_id, 3):
        test = hospital(int(r.client) - 1, SEED).test
        assert r.metrics["eval-c_index"] == pytest.approx(c_index(test.x @ beta, test.time, test.event))
