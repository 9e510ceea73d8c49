"""Every ending of ``quorum simulate`` and ``quorum resume`` with ``--json``, and Ctrl-C (issue 47, item 7).

``--json`` used to print nothing when the command refused its input, when the
run failed on an error, or on Ctrl-C; and Ctrl-C exited 130 while the
README's table says 1 for ``interrupted``. Now each ending prints one JSON
object on stdout (always ``run_id``, ``status``, ``error`` and ``exit_code``;
a run that was stored, the whole summary), and Ctrl-C exits with the table's
code, the run stored ``interrupted``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core.errors import StoreError
from core.outcomes import exit_code
from core.records import RoundRecord
from core.status import RunStatus
from quorum.cli import app
from quorum.progress import RoundDisplay
from runstore.store import RunStore
from tests.conftest import REPO, wait_for

TINY = """name = "tiny"
seed = 3
rounds = {rounds}
[data]
dataset = "digits"
partition = "iid"
server_test_fraction = 0.2
[model]
name = "logreg"
[federation]
clients = 3
min_clients = 1
[training]
lr = 0.1
"""


def scenario_file(folder: Path, rounds: int = 3, extra: str = "") -> Path:
    path = folder / "tiny.toml"
    path.write_text(TINY.format(rounds=rounds) + extra)
    return path


def invoke(*args: str) -> tuple[int, dict[str, Any], str]:
    """``quorum ARGS --json`` in this process: the exit code, the one JSON object on stdout, stderr."""
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exception is None or isinstance(out.exception, SystemExit), out.exception  # no traceback
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout
    return out.exit_code, json.loads(lines[0]), out.stderr


def refusals(tmp_path: Path) -> list[tuple[list[str], str]]:
    """Commands refused before any run is stored, with what their one line says."""
    db = f"sqlite:///{tmp_path / 'r.db'}"
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = 2\n[federation]\nclients = -4\n")
    notes = tmp_path / "notes.db"
    notes.write_text("my notes, not a database\n" * 100)
    unopenable = f"sqlite:///{notes}"
    return [
        (["simulate", str(bad), "--db", db], "federation.clients = -4: must be > 0"),
        (["simulate", str(scenario_file(tmp_path)), "--db", unopenable], "is not an SQLite database"),
        (["simulate", str(scenario_file(tmp_path)), "--db", db, "--ray-address", "auto"], "needs --engine ray"),
        (["resume", "nope", "--db", db], "no run 'nope'"),
        (["resume", "some-run", "--db", unopenable], "is not an SQLite database"),
        (["resume", "--db", db], "name the run to continue"),
        (["resume", "--from", "a", "b", "c", "--db", db], "takes one argument at most"),
    ]


@pytest.mark.parametrize("case", range(7), ids=["bad-scenario", "simulate-unopenable-store", "ray-address",
                                                "unknown-run", "resume-unopenable-store", "no-run", "from-two-args"])
def test_a_refusal_prints_its_json_object_and_exits_2(tmp_path: Path, case: int) -> None:
    # Prepare
    args, said = refusals(tmp_path)[case]
    # Execute
    code, printed, err = invoke(*args)
    # Assert: the object says refused, with the one line's words
    assert code == 2 and said in err and err.count("\n") == 1, err
    assert printed == {"run_id": None, "status": "refused", "error": printed["error"], "exit_code": 2}
    assert said in printed["error"] and printed["error"] in " ".join(err.split())


def test_another_scenario_for_resume_prints_its_json_object_and_exits_2(tmp_path: Path) -> None:
    # Prepare: a finished run of three rounds, and its scenario with five
    db = f"sqlite:///{tmp_path / 'r.db'}"
    code, done, _ = invoke("simulate", str(scenario_file(tmp_path)), "--db", db, "--workers", "1")
    assert code == 0
    # Execute
    code, printed, _ = invoke("resume", done["run_id"], str(scenario_file(tmp_path, rounds=5)), "--db", db)
    # Assert
    assert (code, printed["status"], printed["exit_code"]) == (2, "refused", 2)
    assert "rounds: 3 in the run, 5 in the scenario" in printed["error"]


def on_round_raises(monkeypatch: pytest.MonkeyPatch, error: BaseException, at_round: int = 1) -> None:
    """The display's round callback raises ``error`` once round ``at_round`` is committed (Ctrl-C lands there)."""
    update = RoundDisplay.update

    def raising(display: RoundDisplay, record: RoundRecord) -> None:
        update(display, record)
        if record.round == at_round:
            raise error

    monkeypatch.setattr(RoundDisplay, "update", raising)


def test_a_run_that_fails_on_an_error_prints_its_stored_summary(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: an error of the store once round 1 is committed
    on_round_raises(monkeypatch, StoreError("the disk is full"))
    db = f"sqlite:///{tmp_path / 'r.db'}"
    # Execute
    code, printed, _ = invoke("simulate", str(scenario_file(tmp_path)), "--db", db, "--workers", "1")
    # Assert: the summary of the failed run as stored, with the error
    assert (code, printed["exit_code"], printed["status"], printed["rounds"]) == (1, 1, "failed", 1)
    assert printed["error"] == "StoreError: the disk is full"
    assert RunStore(db).get_run(printed["run_id"]).status == "failed"


def test_ctrl_c_in_process_exits_with_the_tables_code_and_prints_the_summary(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: Ctrl-C once round 2 is committed
    on_round_raises(monkeypatch, KeyboardInterrupt(), at_round=2)
    db = f"sqlite:///{tmp_path / 'r.db'}"
    # Execute
    code, printed, _ = invoke("simulate", str(scenario_file(tmp_path, rounds=5)), "--db", db, "--workers", "1")
    text = CliRunner().invoke(app, ["simulate", str(scenario_file(tmp_path, rounds=5)), "--db", db, "--workers",
                                    "1"])
    # Assert: exit 1 as README's table says, the run stored interrupted after round 2, a summary either way
    assert code == exit_code(RunStatus.INTERRUPTED) == printed["exit_code"] == 1
    assert (printed["status"], printed["rounds"]) == ("interrupted", 2)
    assert RunStore(db).get_run(printed["run_id"]).status == "interrupted"
    assert text.exit_code == 1 and "interrupted: run " in text.stderr, (text.stderr, text.exception)


@pytest.mark.e2e  # a real `quorum simulate` process, interrupted by SIGINT
def test_ctrl_c_on_quorum_simulate_exits_as_the_table_says_prints_json_and_stores_interrupted(tmp_path: Path) -> None:
    # Prepare: a run long enough to be interrupted
    db = f"sqlite:///{tmp_path / 'r.db'}"
    proc = subprocess.Popen([sys.executable, "-m", "quorum", "simulate", str(scenario_file(tmp_path, rounds=400)),
                             "--db", db, "--json", "--workers", "1"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        store = RunStore(db)
        wait_for(lambda: any(run.rounds_done >= 1 for run in store.list_runs()), 120, "round 1 to be committed")

        # Execute: Ctrl-C, as a terminal sends it (to the process group)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    # Assert: the table's code, the JSON object, the run stored interrupted
    printed = json.loads(out)
    assert proc.returncode == exit_code(RunStatus.INTERRUPTED) == printed["exit_code"] == 1, err
    assert printed["status"] == "interrupted" and 1 <= printed["rounds"] < 400
    run = store.get_run(printed["run_id"])
    assert (run.status, run.lease_until) == ("interrupted", None)
