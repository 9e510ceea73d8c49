"""``quorum flower run``: how an app that is not usable, exits on its own or hangs ends (issue 47, item 6).

Every app here is a few files written to ``tmp_path`` as ``flwr new`` lays one
out (``<pkg>/client_app.py``, ``<pkg>/server_app.py``), each under a package
name of its own (Flower imports the app's modules once per process).
Nothing usable: one line ``error: ...`` and exit 2, no traceback, no run. The
app's own ServerApp, run for the initial model, that exits with its own code
or sends nothing within ``--first-message-timeout``: a stored run ``failed``
with that reason, exit 1 (Quorum's code for ``failed``, not the app's), and
nothing of the app left running.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner, Result

from quorum.cli import app
from runstore.store import RunStore
from scenarios.errors import ScenarioError
from scenarios.flower_app import MAX_FIRST_MESSAGE_S, check_seconds

PYPROJECT = """[project]
name = "tiny-{pkg}"
version = "1.0.0"
[tool.flwr.app]
publisher = "tests"
[tool.flwr.app.components]
serverapp = "aggregator.serverapp:app"
clientapp = "{pkg}.client_app:app"
[tool.flwr.app.config]
num-server-rounds = 1
"""
#: A ClientApp with no handler: a train message gets an error reply (no model from a first reply).
CLIENT = "from flwr.clientapp import ClientApp\n\napp = ClientApp()\n"
SERVER = """import os, sys, threading, time
from flwr.serverapp import ServerApp

app = ServerApp()


@app.main()
def main(grid, context):
    open({pidfile!r}, "w").write(str(os.getpid()))
{body}
"""


def write_app(root: Path, *, server_body: str = "    pass", client: str = CLIENT,
              pyproject: bytes | None = None, server: str | None = None) -> Path:
    """A tiny Flower app in ``root / "app"``; its ServerApp's main writes its pid to ``root / "pid"``, then runs
    ``server_body``."""
    pkg = f"tiny_{uuid.uuid4().hex[:8]}"
    folder = root / "app"
    (folder / pkg).mkdir(parents=True)
    (folder / "pyproject.toml").write_bytes(pyproject or PYPROJECT.format(pkg=pkg).encode())
    (folder / pkg / "__init__.py").write_text("")
    (folder / pkg / "client_app.py").write_text(client)
    (folder / pkg / "server_app.py").write_text(
        server or SERVER.format(pidfile=str(root / "pid"), body=server_body))
    return folder


def flower_run(folder: Path, db: str, *options: str) -> Result:
    return CliRunner().invoke(app, ["flower", "run", str(folder), "--clients", "2", "--db", db, *options])


def assert_one_error_line(result: Result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def _pyproject_without(field: str) -> bytes:
    return "\n".join(line for line in PYPROJECT.format(pkg="x").splitlines() if not line.startswith(field)).encode()


# -- an app that is not usable: one line, exit 2, no run ---------------------------------------------------


@pytest.mark.parametrize(("files", "fragments"), [
    ({"pyproject": b"\xff\xfe[project]\nname = 'x'\n"},
     ["pyproject.toml is not UTF-8 text", "byte 0xff at position 0"]),
    ({"pyproject": b"this is = = not toml\n"}, ["pyproject.toml is not a readable pyproject.toml: Expected"]),
    ({"pyproject": b"[project]\nname = 'x'\nversion = '1'\n"},
     ["names no [tool.flwr.app.components] clientapp: not a Flower app"]),
    ({"pyproject": _pyproject_without("publisher")},
     ["pyproject.toml: Flower refuses it: ", "\"publisher\" missing in [tool.flwr.app]"]),
    ({"pyproject": PYPROJECT.format(pkg="x").encode() + b"layers = [1, 2]\n"},
     ["Flower refuses it: The value for key layers needs to be of type"]),
    ({"pyproject": PYPROJECT.format(pkg="nowhere_pkg").encode()},
     ["nowhere_pkg.client_app:app could not be imported", "ModuleNotFoundError: No module named 'nowhere_pkg'"]),
    ({"client": "from flwr.clientapp import ClientApp\n\nclient = ClientApp()\n"},
     [".client_app:app could not be loaded from ", "Unable to load attribute app from module"]),
    ({"client": "import sys\nsys.exit(4)\n"}, [".client_app:app could not be imported", "SystemExit: 4"]),
    ({"client": "def (\n"}, [".client_app:app could not be imported", "SyntaxError"]),
    ({"server": "import no_such_module_here\n"},
     ["no initial model for this Flower app: ", ".server_app:app could not be loaded: ModuleNotFoundError"]),
    ({"server": "import sys\nsys.exit(5)\n"}, [".server_app:app could not be loaded: SystemExit: 5"]),
], ids=["not-utf8", "not-toml", "no-components", "no-publisher", "list-value", "no-module", "no-attribute",
        "client-sys-exit", "client-syntax", "server-no-import", "server-sys-exit-on-import"])
def test_an_unusable_app_is_one_line_and_exit_2_and_no_run(tmp_path: Path, files: dict, fragments: list[str]) -> None:
    # Prepare
    folder = write_app(tmp_path, **files)
    db = f"sqlite:///{tmp_path}/runs.db"

    # Execute
    result = flower_run(folder, db, "--rounds", "1")

    # Assert: one line naming the file or reference and the problem; nothing ran
    assert_one_error_line(result, *fragments)
    assert RunStore(db).list_runs() == []


# -- the app's own ServerApp exits with its own code: the run fails, exit 1 --------------------------------


@pytest.mark.parametrize(("body", "said"), [
    ("    sys.exit(3)", "exited with code 3 (SystemExit)"),  # 3 is `degraded` in Quorum's table: not passed on
    ("    sys.exit('no GPU here')", "exited with code 1 (SystemExit: no GPU here)"),
    ("    os._exit(7)", "ended its process with exit code 7"),
], ids=["sys-exit-3", "sys-exit-message", "os-exit"])
def test_a_serverapp_that_exits_with_its_own_code_fails_the_run_and_exits_1(tmp_path: Path, body: str,
                                                                            said: str) -> None:
    # Prepare
    folder = write_app(tmp_path, server_body=body)
    db = f"sqlite:///{tmp_path}/runs.db"

    # Execute
    result = flower_run(folder, db)

    # Assert: Quorum's code for `failed`, a line naming the app's own code; the run stored failed with it
    assert result.exit_code == 1, (result.stderr, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert any(line.startswith("failed: run ") for line in lines), lines
    assert any(line.strip().startswith("failed: never started: the app's ServerApp ") and said in line
               and line.endswith("before its first message") for line in lines), lines
    (run,) = RunStore(db).list_runs()
    assert run.status == "failed" and run.rounds_done == 0
    assert said in run.error


# -- the app's own ServerApp never sends: stopped at --first-message-timeout -------------------------------


HANGS_ON_IMPORT = "import os, threading\nopen({pidfile!r}, 'w').write(str(os.getpid()))\nthreading.Event().wait()\n"


@pytest.mark.parametrize("where", ["main", "import"])
def test_a_serverapp_that_never_sends_is_stopped_at_the_first_message_timeout(tmp_path: Path, where: str) -> None:
    # Prepare: a ServerApp whose main blocks for ever, or whose module does as it is imported
    hang = {"main": {"server_body": "    threading.Event().wait()"},
            "import": {"server": HANGS_ON_IMPORT.format(pidfile=str(tmp_path / "pid"))}}[where]
    folder = write_app(tmp_path, **hang)
    db = f"sqlite:///{tmp_path}/runs.db"
    threads, children = threading.active_count(), psutil.Process().children(recursive=True)

    # Execute
    started = time.monotonic()
    result = flower_run(folder, db, "--first-message-timeout", "2")
    took = time.monotonic() - started

    # Assert: exit 1 soon after the 2 s; the run failed with the reason; the app's process is gone, no thread left
    assert result.exit_code == 1, (result.stderr, result.exception)
    assert 2.0 <= took < 15.0, took
    assert any("failed: never started: the app's ServerApp " in line and "sent no message in 2 s" in line
               for line in result.stderr.splitlines()), result.stderr
    (run,) = RunStore(db).list_runs()
    assert run.status == "failed" and "sent no message in 2 s and was stopped" in run.error
    assert "first-message-timeout-s" in run.error  # what to raise
    probe = int((tmp_path / "pid").read_text())
    assert not psutil.pid_exists(probe)
    assert psutil.Process().children(recursive=True) == children
    assert threading.active_count() == threads


@pytest.mark.e2e  # the app starts a program of its own
def test_whatever_a_hung_serverapp_started_is_stopped_with_it(tmp_path: Path) -> None:
    # Prepare: a ServerApp that starts `sleep` (its pid to a file), then blocks
    body = (f"    import subprocess\n    child = subprocess.Popen(['sleep', '600'])\n"
            f"    open({str(tmp_path / 'grandchild')!r}, 'w').write(str(child.pid))\n    time.sleep(600)")
    folder = write_app(tmp_path, server_body=body)

    # Execute
    result = flower_run(folder, f"sqlite:///{tmp_path}/runs.db", "--first-message-timeout", "3")

    # Assert: the run failed at 3 s, and the ServerApp's process and the program it started are both gone
    assert result.exit_code == 1, (result.stderr, result.exception)
    assert "sent no message in 3 s" in result.stderr
    for name in ("pid", "grandchild"):
        pid = int((tmp_path / name).read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, name


# -- the option's bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "1e308", "86400.5"])
def test_a_first_message_timeout_out_of_bounds_is_refused_by_name(tmp_path: Path, value: str) -> None:
    folder = write_app(tmp_path)
    db = f"sqlite:///{tmp_path}/runs.db"

    result = flower_run(folder, db, f"--first-message-timeout={value}")

    assert_one_error_line(result, "--first-message-timeout = ", "expected seconds above 0 and at most 86400")
    assert RunStore(db).list_runs() == []


def test_the_run_configs_first_message_timeout_is_checked_by_name_too(tmp_path: Path) -> None:
    folder = write_app(tmp_path)

    result = flower_run(folder, f"sqlite:///{tmp_path}/runs.db", "--run-config", '{"first-message-timeout-s": "soon"}')

    assert_one_error_line(result, "run config first-message-timeout-s = 'soon': expected seconds above 0")


@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**1100), 2**1100),
                       st.just(10**5000), st.booleans(), st.none(), st.text(max_size=5)))
def test_check_seconds_takes_what_is_in_bounds_and_refuses_the_rest_by_name(value: object) -> None:
    # The option's and the run config's one check: (0, a day], finite, a number (a bool is no number here)
    try:
        seconds = check_seconds("--first-message-timeout", value)
    except ScenarioError as exc:
        assert str(exc).startswith("--first-message-timeout = ") and "\n" not in str(exc)
        assert isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_FIRST_MESSAGE_S
        return
    assert math.isfinite(seconds) and 0 < seconds <= MAX_FIRST_MESSAGE_S and seconds == value
