"""``quorum flower run APP_DIR``: a stock Flower app in one command, in this process (typer's CliRunner)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from quorum.cli import app
from runstore.store import RunStore
from tests.conftest import REPO

NUMPY_APP = REPO / "tests" / "flower_examples" / "quickstart-numpy"


def test_flower_run_prints_a_line_per_round_and_exits_0(tmp_path: Path) -> None:
    # Execute: Flower's official quickstart-numpy (its pyproject points serverapp at Quorum's)
    db = f"sqlite:///{tmp_path}/runs.db"
    result = CliRunner().invoke(app, ["flower", "run", str(NUMPY_APP), "--clients", "3", "--rounds", "2",
                                      "--db", db])

    # Assert: one line per round naming its clients, the ending, and the run in the store
    assert result.exit_code == 0, (result.stderr, result.exception)
    lines = result.stderr.splitlines()
    assert any(line.startswith("round 1/2: ") and "clients 3/3 answered" in line for line in lines), lines
    assert any(line.startswith("round 2/2: ") for line in lines)
    assert any(line.startswith("finished: run ") and "quickstart-numpy, 2 rounds" in line for line in lines)
    (run,) = RunStore(db).list_runs()
    assert run.status == "finished" and run.rounds_done == 2
    assert run.info["model"].startswith("quickstart_numpy.server_app:app")


def test_flower_run_of_a_failing_app_exits_1_and_of_no_app_exits_2(tmp_path: Path) -> None:
    # Prepare: a copy of the numpy example whose ClientApp raises in every call
    broken = tmp_path / "broken"
    (broken / "brokenapp").mkdir(parents=True)
    (broken / "pyproject.toml").write_text(
        (NUMPY_APP / "pyproject.toml").read_text().replace("quickstart_numpy.", "brokenapp."))
    (broken / "brokenapp" / "__init__.py").write_text("")
    (broken / "brokenapp" / "client_app.py").write_text(
        "from flwr.clientapp import ClientApp\n\napp = ClientApp()\n\n\n@app.train()\ndef train(msg, context):\n"
        "    raise ValueError('no data on this node')\n")
    (broken / "brokenapp" / "server_app.py").write_text(
        (NUMPY_APP / "quickstart_numpy" / "server_app.py").read_text().replace("quickstart_numpy.", "numpyfix."))
    (broken / "numpyfix").mkdir()
    (broken / "numpyfix" / "__init__.py").write_text("")
    (broken / "numpyfix" / "task.py").write_text((NUMPY_APP / "quickstart_numpy" / "task.py").read_text())
    db = f"sqlite:///{tmp_path}/runs.db"

    # Execute
    failed = CliRunner().invoke(app, ["flower", "run", str(broken), "--clients", "2", "--rounds", "1", "--db", db])
    missing = CliRunner().invoke(app, ["flower", "run", str(tmp_path / "nowhere"), "--db", db])

    # Assert: the failure names the client's error; a folder that is no Flower app is one line and exit 2
    assert failed.exit_code == 1, (failed.stderr, failed.exception)
    assert "ValueError: no data on this node" in failed.stderr
    assert "failed: " in failed.stderr
    assert missing.exit_code == 2 and "is not a readable pyproject.toml" in missing.stderr
