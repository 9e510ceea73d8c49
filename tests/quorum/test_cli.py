"""The ``quorum`` command as a user runs it.

One test runs the real ``python -m quorum`` process (the entry point, JSON on
its stdout); the others call the same Typer app in this process through
typer's ``CliRunner`` (exit code, stdout and stderr apart), which spares each
of them a Python start and the torch import without changing what the command
does or prints.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from runstore.store import RunStore
from tests.conftest import REPO

TINY = """
name = "cli-tiny"
seed = 5
rounds = 2
[data]
dataset = "digits"
[model]
name = "logreg"
[federation]
clients = 3
min_clients = 1
[training]
lr = 0.1
"""


def quorum(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quorum", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=check)


def cli(*args: str, check: bool = True) -> Result:
    """``quorum ARGS`` in this process; ``check``: the command must exit 0."""
    from quorum.cli import app

    result = CliRunner().invoke(app, list(args))
    if check:
        assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result


def assert_clean_exit_2(out: Result) -> None:
    """Exit status 2 by the command's own error path (``typer.Exit``), not an uncaught exception."""
    assert out.exit_code == 2, (out.stderr, out.exception)
    assert isinstance(out.exception, SystemExit), out.exception


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    folder = tmp_path_factory.mktemp("cli")
    scenario = folder / "cli-tiny.toml"
    scenario.write_text(TINY)
    db = f"sqlite:///{folder / 'runs.db'}"
    out = cli("simulate", str(scenario), "--db", db, "--json", "--rounds", "3", "--seed", "9")
    return json.loads(out.stdout)["run_id"], db, folder


def test_simulate_json_has_the_promised_keys(finished_run: tuple[str, str, Path]) -> None:
    run_id, db, _ = finished_run
    runs = cli("runs", "--db", db).stdout
    assert run_id in runs and "3/3" in runs


@pytest.mark.e2e
def test_simulate_json_fields(tmp_path: Path) -> None:
    scenario = tmp_path / "cli-tiny.toml"
    scenario.write_text(TINY)
    out = quorum("simulate", str(scenario), "--db", f"sqlite:///{tmp_path / 'r.db'}", "--json")
    summary = json.loads(out.stdout)
    for key in ("run_id", "scenario", "strategy", "rounds", "final_accuracy", "final_loss",
                "final_train_loss", "wall_s"):
        assert key in summary
    assert summary["rounds"] == 2 and summary["scenario"] == "cli-tiny" and summary["strategy"] == "fedavg"
    assert 0 < summary["final_accuracy"] <= 1


@pytest.mark.e2e
def test_the_command_starts_without_the_store_torch_or_flower() -> None:
    # Every `quorum` call (a `--help`, `client keygen`, `aggregator status`) pays its imports first: the
    # store's SQLAlchemy and Flower records were 0.7 s of the 0.9 s before any command ran. A fresh
    # interpreter shows what importing the command pulls in.
    probe = ("import sys, quorum.cli; "
             "print(sorted(m for m in ('sqlalchemy', 'torch', 'flwr', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_report_writes_plots_and_summary(finished_run: tuple[str, str, Path]) -> None:
    run_id, db, folder = finished_run
    cli("report", run_id, "--db", db, "--out", str(folder / "report"))
    summary = json.loads((folder / "report" / "summary.json").read_text())
    assert summary["rounds_done"] == 3 and summary["seed"] == 9
    # the wire's bytes: the run's totals are the sums of its rounds'
    assert summary["uplink_bytes"] == sum(r["bytes_in"] for r in summary["rounds"]) > 0
    assert summary["downlink_bytes"] == sum(r["bytes_out"] for r in summary["rounds"]) > 0
    for png in ("accuracy_loss.png", "clients.png", "accuracy_bytes.png"):
        assert (folder / "report" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_malformed_scenario_is_one_named_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = 2\n[federation]\nclients = -4\n")
    out = cli("simulate", str(bad), "--db", f"sqlite:///{tmp_path / 'r.db'}", check=False)
    assert_clean_exit_2(out)
    assert "federation.clients = -4: must be > 0" in out.stderr and str(bad) in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_run_is_a_clear_error(tmp_path: Path) -> None:
    out = cli("resume", "nope", "--db", f"sqlite:///{tmp_path / 'r.db'}", check=False)
    assert_clean_exit_2(out)
    assert "no run 'nope'" in out.stderr


@pytest.mark.parametrize(
    ("extra_toml", "args", "message"),
    [
        ("", ("--seed", "-1"), "seed = -1: must be >= 0"),
        ("", ("--rounds", str(10**20)), "rounds = 100000000000000000000: is out of range"),
        ("[secagg]\nenabled = true\nbits = 32.0\n", (), "secagg.bits = 32.0: must be one of 16, 32, 64"),
    ],
    ids=["seed-negative", "rounds-1e20", "secagg-bits-float"],
)
def test_hostile_settings_are_one_line_and_leave_no_running_row(tmp_path: Path, extra_toml: str,
                                                                 args: tuple[str, ...], message: str) -> None:
    # Prepare (the loader's other hostile values are in tests/scenarios/test_schema_untrusted.py)
    scenario = tmp_path / "hostile.toml"
    scenario.write_text(TINY + extra_toml)
    db = f"sqlite:///{tmp_path / 'r.db'}"
    # Execute
    out = cli("simulate", str(scenario), "--db", db, *args, check=False)
    # Assert
    assert_clean_exit_2(out)
    assert message in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1  # one line
    assert [run.status for run in RunStore(db).list_runs()] == []


# -- exit codes: 0 finished, 3 degraded, 1 failed (issue 32, item 6) ----------------------------------

FLAKY_TASK = '''
from learning.errors import DataError
from learning.tasks.classification import ClassificationTask


class Flaky(ClassificationTask):
    """The digits task, but partition 2 (node 3) holds a file without its label column."""

    def partition(self, partition_id):
        if partition_id == 2:
            raise DataError("no label column 'label'")
        return super().partition(partition_id)
'''


def test_simulate_and_resume_exit_3_when_a_client_failed_every_round_and_name_it(tmp_path: Path) -> None:
    # Prepare: three clients, node 3's task raises each time it is asked
    (tmp_path / "flaky_task.py").write_text(FLAKY_TASK)
    scenario = tmp_path / "flaky.toml"
    scenario.write_text(TINY + '[task]\nentry = "flaky_task:Flaky"\n')
    db = f"sqlite:///{tmp_path / 'r.db'}"

    # Execute
    out = cli("simulate", str(scenario), "--db", db, "--workers", "1", check=False)
    as_json = cli("simulate", str(scenario), "--db", db, "--workers", "1", "--json", "--rounds", "1", check=False)

    # Assert: each round line counts and names the failure; the run is degraded, with the reason, exit 3
    assert out.exit_code == 3, (out.stderr, out.exception)
    text = " ".join(out.stderr.split())
    assert "clients 2/3 answered, 1 failed: client 3 DataError: no label column 'label'" in text
    assert ("degraded: client 3 failed in 2 of 2 rounds (DataError: no label column 'label')") in text
    summary = json.loads(as_json.stdout)
    assert (as_json.exit_code, summary["exit_code"], summary["status"]) == (3, 3, "degraded")
    # resume of that ended run leaves it as it is and exits with its code, with the same line
    again = cli("resume", summary["run_id"], "--db", db, check=False)
    assert again.exit_code == 3, (again.stderr, again.exception)
    assert "degraded: client 3 failed in 1 of 1 rounds (DataError: no label column 'label')" in " ".join(
        again.stderr.split())
    assert summary["clients"] == {"answered": 2, "dropped": 0, "rejected": 0, "failed": 1, "refused": 0}
    assert summary["error"].startswith("client 3 failed in 1 of 1 rounds")


def test_simulate_exits_1_when_the_run_fails(tmp_path: Path) -> None:
    # Prepare: secure aggregation that needs all 3 clients at every stage, and a third of them vanish
    scenario = tmp_path / "unmet.toml"
    scenario.write_text(TINY + "[secagg]\nenabled = true\nthreshold = 3\nthreat_model = \"semi-honest\"\n"
                        "[faults]\ndropouts = { advertise_keys = 0.34 }\n")

    # Execute
    out = cli("simulate", str(scenario), "--db", f"sqlite:///{tmp_path / 'r.db'}", "--workers", "1",
              check=False)

    # Assert: no round could change the model: failed, exit 1, with why
    assert out.exit_code == 1, (out.stderr, out.exception)
    assert "failed: no round changed the model: all 2 rounds skipped or rejected" in " ".join(out.stderr.split())


def test_simulate_exits_0_when_every_client_contributed(finished_run: tuple[str, str, Path]) -> None:
    run_id, db, _ = finished_run  # the fixture's cli() call asserted exit 0
    assert RunStore(db).get_run(run_id).status == "finished"


def _unopenable_stores(folder: Path) -> list[tuple[str, str]]:
    """(URL, what the one line must say) for stores that cannot be opened, each made in ``folder``."""
    (folder / "notes.db").write_text("my notes, not a database\n" * 100)
    (folder / "a-folder.db").mkdir()
    (folder / "a-file").write_text("x")
    return [(f"sqlite:///{folder / 'notes.db'}", "is not an SQLite database"),
            (f"sqlite:///{folder / 'a-folder.db'}", "is a folder, not a database file"),
            (f"sqlite:///{folder / 'a-file' / 'under' / 'q.db'}", "cannot be opened"),
            ("not a url", "give an SQLAlchemy URL"),
            ("bogusdialect://x/y", "give an SQLAlchemy URL"),
            ("postgresql+psycopg://nobody@127.0.0.1:1/none", "check that the database server is running")]


@pytest.mark.parametrize("command", [["runs"], ["report", "some-run"], ["export", "some-run", "--out", "OUT"],
                                     ["resume", "some-run"]])
def test_a_store_that_cannot_be_opened_is_one_line_naming_it_and_exit_2(tmp_path: Path, command: list[str]) -> None:
    for url, said in _unopenable_stores(tmp_path):
        # Execute
        out = cli(*[str(tmp_path / "out") if a == "OUT" else a for a in command], "--db", url, check=False)

        # Assert: one line naming the store (its text) and what is wrong; no traceback
        assert_clean_exit_2(out)
        line = out.stderr.strip()
        assert len(line.splitlines()) == 1 and said in line, (url, out.stderr)
        assert url.removeprefix("sqlite:///").split("/")[-1] in line or url in line, (url, line)


def test_a_store_from_a_newer_quorum_is_one_line_for_runs(tmp_path: Path) -> None:
    # Prepare: a store whose alembic revision this version does not know
    import sqlalchemy as sa

    db = f"sqlite:///{tmp_path / 'r.db'}"
    RunStore(db).close()
    engine = sa.create_engine(db)
    with engine.begin() as c:
        c.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()

    # Execute
    out = cli("runs", "--db", db, check=False)

    # Assert
    assert_clean_exit_2(out)
    assert "revision 9999, newer than this Quorum knows" in out.stderr and "Traceback" not in out.stderr


def test_runs_refuses_a_status_that_does_not_exist_and_lists_the_real_ones(tmp_path: Path) -> None:
    out = cli("runs", "--db", f"sqlite:///{tmp_path / 'r.db'}", "--status", "bogus", check=False)
    assert out.exit_code == 2
    assert "'bogus'" in out.stderr and "interrupted" in out.stderr and "finished" in out.stderr


def test_a_store_url_with_a_bad_port_is_one_line_without_its_password(tmp_path: Path) -> None:
    out = cli("runs", "--db", "postgresql+psycopg://me:s3cret@127.0.0.1:notaport/db", check=False)
    assert_clean_exit_2(out)
    assert "s3cret" not in out.stderr and "give an SQLAlchemy URL" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
