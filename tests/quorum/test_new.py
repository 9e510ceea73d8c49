"""``quorum new``: a project that runs at once, whose task file is where the user's model goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from runstore.report import write_report
from runstore.store import RunStore
from tests.conftest import REPO


def quorum(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "quorum", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, check=False, env=env)


def quorum_here(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> Result:
    """``quorum ARGS`` run in this process from ``cwd`` (typer's CliRunner: exit code, stdout, stderr apart).

    For the checks that are not about a fresh process: it spares each a Python start and the torch import.
    """
    from quorum.cli import app

    monkeypatch.chdir(cwd)
    return CliRunner().invoke(app, list(args))


@pytest.mark.e2e
def test_new_project_runs_and_follows_an_edit_of_its_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a project, whose MLP's hidden layer the user narrows from 64 to 32 units in task.py.
    # Parameters by hand: 64*32 + 32 (hidden) + 32*10 + 10 (output) = 2,410 (64 units: 4,810).
    made = quorum_here("new", "demo-task", cwd=tmp_path, monkeypatch=monkeypatch)
    assert made.exit_code == 0, (made.stderr, made.exception)
    task = tmp_path / "demo-task" / "task.py"
    source = task.read_text()
    assert source.count("hidden: int = 64") == 1
    task.write_text(source.replace("hidden: int = 64", "hidden: int = 32"))
    scenario = tmp_path / "demo-task" / "scenario.toml"
    scenario.write_text(scenario.read_text().replace("hidden = 64", "# hidden: the task file's default"))
    db = f"sqlite:///{tmp_path / 'runs.db'}"

    # Execute: a real process started in another folder, so the entry "task:MyTask" must resolve beside
    # the scenario (and this test process never imports the user's task module)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = quorum("simulate", str(scenario), "--rounds", "2", "--db", db, "--json", cwd=elsewhere)

    # Assert
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    stored = RunStore(db).get_run(summary["run_id"])
    assert summary["status"] == "finished" and summary["rounds"] == 2
    assert stored.num_params == 2410
    assert summary["final_accuracy"] is not None and summary["final_accuracy"] > 0.3  # 10 classes: chance 0.1


def test_new_refuses_a_folder_that_is_not_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    result = quorum_here("new", "taken", cwd=tmp_path, monkeypatch=monkeypatch)
    assert isinstance(result.exception, SystemExit), result.exception  # the command's own exit, no traceback
    assert result.exit_code == 2 and "already exists and is not an empty folder" in result.stderr
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("name", ["-rf", "bad name"])
def test_new_refuses_a_name_that_is_not_plain(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    result = quorum_here("new", "--", name, cwd=tmp_path, monkeypatch=monkeypatch)
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2 and "must be letters, digits" in result.stderr


def test_the_regression_scenario_reaches_store_and_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    db = f"sqlite:///{tmp_path / 'runs.db'}"

    # Execute
    run = quorum_here("simulate", str(REPO / "scenarios" / "regression.toml"), "--rounds", "2", "--db", db,
                      "--json", cwd=tmp_path, monkeypatch=monkeypatch)
    assert run.exit_code == 0, (run.stderr, run.exception)
    summary = json.loads(run.stdout)
    store = RunStore(db)
    rounds = store.rounds(summary["run_id"])
    paths = write_report(store, summary["run_id"], tmp_path / "report")

    # Assert: the task's own metrics per round, plotted; no accuracy for a regression
    assert summary["status"] == "finished" and summary["final_accuracy"] is None
    assert [r.round for r in rounds] == [1, 2]
    for r in rounds:
        assert {"server-mae", "server-rmse", "server-r2"} <= set(r.metrics)
        assert r.metrics["server-mae"] > 0 and r.metrics["server-rmse"] >= r.metrics["server-mae"]
    assert (tmp_path / "report" / "metrics.png") in paths
    report = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert report["final_metrics"]["server-r2"] == pytest.approx(rounds[-1].metrics["server-r2"])
