"""A device's setup mistakes give one line naming the fix, and no restart loop (issue 17, item 1)."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.agent_console import AgentConsole
from deploy.pki import ensure_tls
from deploy.preflight import (
    ACTIVATION_GRACE_S,
    PreflightError,
    SupernodeDiagnosis,
    check_ca,
    check_port,
    free_port,
)
from tests.conftest import REPO


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A TLS listener on 127.0.0.1 with a certificate from a CA made here: (HOST:PORT, that CA's file)."""
    files = ensure_tls(tmp_path / "tls", ["127.0.0.1", "localhost"])
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(files.server_cert), str(files.server_key))
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except (OSError, ssl.SSLError):
                pass  # the client refused our certificate: that is the test
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}", files.ca_cert
    stop.set()
    thread.join(5)
    listener.close()


@pytest.mark.e2e
def test_the_right_ca_passes_and_a_wrong_one_names_the_fix(tls_server: tuple[str, Path], tmp_path: Path) -> None:
    server, ca = tls_server
    assert check_ca(server, ca) is None
    other = ensure_tls(tmp_path / "other", ["127.0.0.1"]).ca_cert
    with pytest.raises(PreflightError, match=r"does not verify the aggregator's certificate .* copy ca.pem"):
        check_ca(server, other)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(PreflightError, match="not a PEM certificate"):
        check_ca(server, junk)


@pytest.mark.e2e
def test_an_unreachable_aggregator_is_a_warning_not_a_mistake(tls_server: tuple[str, Path]) -> None:
    _, ca = tls_server
    warning = check_ca(f"127.0.0.1:{free_port()}", ca, timeout_s=2)
    assert warning is not None and "keeps trying" in warning
    with pytest.raises(PreflightError, match="expected HOST:PORT"):
        check_ca("no-port-here", ca)


@pytest.mark.e2e
def test_a_busy_port_is_named_with_the_fix() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(PreflightError, match=f"--runtime-port {port}: the port is in use .* leave --runtime-port "
                                                 "unset"):
            check_port(port)
    check_port(port)  # free again


def test_a_refused_key_is_fatal_only_after_a_crash_restart_could_explain_it(tmp_path: Path) -> None:
    log = tmp_path / "supernode.log"
    log.write_text("old run: Failed to activate SuperNode.\n")
    diag = SupernodeDiagnosis(log, "ward-7", grace_s=90, offset=log.stat().st_size)
    assert diag.after_exit(now=0) is None                    # nothing new logged
    with log.open("a") as out:
        out.write("ERROR: Failed to activate SuperNode.\n")
    assert diag.after_exit(now=10) is None                   # first refusal: a restart after a crash
    with log.open("a") as out:
        out.write("ERROR: Failed to activate SuperNode.\n")
    why = diag.after_exit(now=120)
    assert why is not None and "quorum client enroll ward-7" in why and "revoked" in why


def test_other_fatal_log_lines_and_a_recovery(tmp_path: Path) -> None:
    log = tmp_path / "supernode.log"
    log.write_text("")
    diag = SupernodeDiagnosis(log)
    with log.open("a") as out:
        out.write("ERROR: Failed to activate SuperNode.\n")
    assert diag.after_exit(now=0) is None
    with log.open("a") as out:
        out.write("connection reset, retrying\n")            # a different exit: the refusal clock restarts
    assert diag.after_exit(now=200) is None and diag.refused_since is None
    with log.open("a") as out:
        out.write("OSError: [Errno 98] Address already in use\n")
    assert "pick another --runtime-port" in (diag.after_exit(now=201) or "")
    with log.open("a") as out:
        out.write("ssl: CERTIFICATE_VERIFY_FAILED\n")
    assert "copy ca.pem" in (diag.after_exit(now=202) or "")


@pytest.mark.e2e
def test_client_start_refuses_a_wrong_ca_in_one_line(tls_server: tuple[str, Path], tmp_path: Path) -> None:
    server, _ = tls_server
    other = ensure_tls(tmp_path / "other", ["127.0.0.1"])
    key = tmp_path / "dev.key"
    key.write_text("unused: the check fails before the key is read")
    data = tmp_path / "data.csv"
    data.write_text("label,x\n0,1\n")
    done = subprocess.run([sys.executable, "-m", "quorum", "client", "start", "--server", server, "--data", str(data),
                           "--key", str(key), "--ca", str(other.ca_cert), "--workdir", str(tmp_path / "agent")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    message = " ".join((done.stdout + done.stderr).split())
    assert "does not verify the aggregator's certificate" in message and "restarting" not in message


def test_the_agent_relays_task_outcomes_and_the_connection(tmp_path: Path) -> None:
    from deploy.agent_console import Relay
    worker, node = tmp_path / "worker.log", tmp_path / "supernode.log"
    worker.write_text("12:00:00 quorum-worker: task 1 completed (before this agent)\n")
    said: list[str] = []
    relay = Relay({worker: [("quorum-worker: ", "{}")],
                    node: [("SuperNode ID: ", "connected to the aggregator as node {}")]}, said.append)
    with worker.open("a") as out:
        out.write("noise\n12:00:01 quorum-worker: task 2 failed: DataError: no column 'label' in 3.1")
    node.write_text("INFO :      SuperNode ID: 4242\n")
    relay.poll()
    assert said == ["connected to the aggregator as node 4242"]  # the worker's line is not finished yet
    with worker.open("a") as out:
        out.write("2 s\n")
    relay.poll()
    assert said[-1] == "task 2 failed: DataError: no column 'label' in 3.12 s"


@pytest.mark.e2e
def test_a_lost_aggregator_is_said_with_its_cause_and_the_countdown(tmp_path: Path) -> None:
    logs = tmp_path / "agent" / "logs"
    logs.mkdir(parents=True)
    (logs / "supernode.log").write_text("")
    with socket.create_server(("127.0.0.1", 0)) as gone:
        port = gone.getsockname()[1]  # closed when the block ends: nothing listens there afterwards
    said: list[str] = []
    console = AgentConsole(logs, "ward-7", said.append, server=f"127.0.0.1:{port}")
    with (logs / "supernode.log").open("a") as out:
        out.write("WARNING :   Connection attempt failed, retrying in 4.37 seconds\n")
    console.poll()
    assert said == [f"the aggregator at 127.0.0.1:{port} is unreachable (Connection refused); retrying in 4 s"]


def test_a_reply_is_summarised_by_its_kind_and_numbers() -> None:
    from types import SimpleNamespace

    from deploy.agent_console import reply_summary
    metrics = {"train-loss": 0.41234, "num-examples": 40, "note": "x"}
    reply = SimpleNamespace(metadata=SimpleNamespace(message_type="train"),
                            content=SimpleNamespace(metric_records={"metrics": metrics}))
    assert reply_summary(reply) == " (train, train-loss 0.4123, num-examples 40)"
    assert reply_summary(None) == ""


def test_one_workdir_one_agent(tmp_path: Path) -> None:
    from deploy.preflight import lock_workdir
    held = lock_workdir(tmp_path / "agent")
    try:
        with pytest.raises(PreflightError, match="another client agent runs there"):
            lock_workdir(tmp_path / "agent")
        lock_workdir(tmp_path / "other").close()
    finally:
        held.close()
    lock_workdir(tmp_path / "agent").close()  # free again once the first agent is gone


def test_an_error_reply_is_not_shown_as_a_completed_task() -> None:
    from types import SimpleNamespace

    from deploy.agent_console import reply_summary
    reply = SimpleNamespace(has_error=lambda: True, error=SimpleNamespace(reason="secagg: stage timed out"))
    assert reply_summary(reply) == " (answered with an error: secagg: stage timed out)"


def test_a_data_file_the_builtin_tasks_would_trip_on_is_named(tmp_path: Path) -> None:
    import numpy as np

    from deploy.preflight import check_data
    header = ",".join(["target"] + [f"pixel{i}" for i in range(784)])
    wrong = tmp_path / "wrong.csv"
    wrong.write_text(header + "\n" + ",".join(["3"] + ["0"] * 784) + "\n")
    [message] = check_data(wrong)
    assert "no 'label' column (it has target, pixel0, pixel1, pixel2, pixel3, ... (785 columns))" in message
    assert "pixel700" not in message                          # never the whole column list
    raw = tmp_path / "raw.csv"
    raw.write_text("label,a,b,c\n1,0,255,60\n0,12,3,-70\n")
    [message] = check_data(raw)
    assert message == (f"--data {raw}: feature 'b' ranges from 3 to 255 (and 1 more feature beyond ±50): unscaled "
                       "features make training diverge; set [data] standardize = \"federated\" in the scenario (as "
                       "scenarios/devices.toml does), or scale every feature to about unit size")
    assert "pixels" not in message
    scaled = tmp_path / "scaled.csv"
    scaled.write_text("label,a,b\n1,0.1,-1.5\n0,2,3\n")
    assert check_data(scaled) == [] and check_data(tmp_path) == []  # a folder (text) is its task's business
    np.savez(tmp_path / "bad.npz", features=np.zeros((2, 2)))
    assert "needs arrays 'x' and 'y'" in check_data(tmp_path / "bad.npz")[0]
    (tmp_path / "bin.csv").write_bytes(b"label,a\n\xff\xfe,1\n")
    assert "not a readable CSV text file" in check_data(tmp_path / "bin.csv")[0]


@pytest.mark.parametrize(("error", "public"), [
    (ValueError("/home/ana/ward7/local.csv: no column 'label' (columns: target, p0, p1, p2, p3, p4, p5, p6)"),
     "ValueError: no column 'label' (columns: target, p0, p1, p2, ..."),
    (OSError("C:\\\\Users\\\\ana\\\\data.csv not found"), "OSError: <path> not found"),
    (KeyError("x"), "KeyError: 'x'"),
    (ValueError("data/local.csv: line 5, column 'mean_radius': 'n/a' is not a number"),
     "ValueError: line 5, column 'mean_radius': 'n/a' is not a number"),
    (ValueError("speed in km/h, ./cache and ~/x.csv and /srv/a"),
     "ValueError: speed in km/h, <path> and <path> and <path>"),
])
def test_a_failed_task_tells_the_aggregator_no_paths_or_column_lists(error: Exception, public: str) -> None:
    from deploy.agent_console import public_reason
    assert public_reason(error) == public
    assert len(public_reason(ValueError("x" * 1000))) == 200


def test_client_status_reports_the_agent_its_node_and_its_last_tasks(tmp_path: Path) -> None:
    from deploy.agent_console import agent_report
    from deploy.preflight import lock_workdir
    workdir = tmp_path / "agent"
    assert agent_report(workdir) == {"workdir": str(workdir), "running": None, "node_id": None, "tasks": []}
    (workdir / "logs").mkdir(parents=True)
    (workdir / "logs" / "supernode.log").write_text("INFO : SuperNode ID: 11\nINFO : SuperNode ID: 12\n")
    (workdir / "logs" / "worker.log").write_text(
        "".join(f"12:00:0{i} quorum-worker: task {i} completed (train)\n" for i in range(3)))
    held = lock_workdir(workdir)
    try:
        report = agent_report(workdir, tasks=2)
    finally:
        held.close()
    assert report["running"] == os.getpid() and report["node_id"] == "12"
    assert report["tasks"] == ["task 1 completed (train)", "task 2 completed (train)"]
    assert agent_report(workdir)["running"] is None


def test_without_a_recent_session_the_first_refusal_names_the_fix(tmp_path: Path) -> None:
    log = tmp_path / "supernode.log"
    log.write_text("")
    diag = SupernodeDiagnosis(log, "ward-7", grace_s=90)
    with log.open("a") as out:
        out.write("ERROR: Failed to activate SuperNode.\n")
    why = diag.after_exit(now=0, recent_session=False)
    assert why is not None and why.startswith("the aggregator refuses this device's key: it is not enrolled")


def test_the_console_marks_a_session_and_a_refusal_within_its_grace_waits(tmp_path: Path) -> None:
    logs = tmp_path / "agent" / "logs"
    logs.mkdir(parents=True)
    (logs / "supernode.log").write_text("")
    said: list[str] = []
    console = AgentConsole(logs, "ward-7", said.append)
    assert not console.recent_session()                      # a fresh workdir: never connected
    with (logs / "supernode.log").open("a") as out:
        out.write("INFO : SuperNode ID: 42\n")
    console.poll()
    assert said == ["connected to the aggregator as node 42"] and console.recent_session()
    with (logs / "supernode.log").open("a") as out:
        out.write("ERROR: Failed to activate SuperNode.\n")  # a crash, then the old session still holds the key
    assert console.after_exit("supernode", 1, 1, None, 1.0) is None
    assert said[-1].startswith("supernode exited (rc 1): the aggregator refused this device's key (revoked or "
                               "not enrolled, or this device's previous session is still open: trying 90 s more")
    old = time.time() - ACTIVATION_GRACE_S - 5                # the session ended long ago
    os.utime(tmp_path / "agent" / "session", (old, old))
    with (logs / "supernode.log").open("a") as out:
        out.write("ERROR: Failed to activate SuperNode.\n")
    assert console.after_exit("supernode", 1, 2, None, 1.0) == 3
    assert "quorum client enroll ward-7" in said[-1]


def test_the_start_warning_and_the_task_error_locate_a_bad_cell_alike(tmp_path: Path) -> None:
    # Prepare: an "n/a" cell on the file's line 5, in column 'mean_radius'
    from deploy.agent_console import public_reason
    from deploy.preflight import check_data
    from learning.datasets import load_file
    from learning.errors import DataError

    data = tmp_path / "local.csv"
    data.write_text("label,mean_radius,mean_area\n1,12.5,0.4\n0,13.1,0.2\n\n1,n/a,0.3\n")

    # Execute
    [warning] = check_data(data)
    with pytest.raises(DataError) as task_error:
        load_file(data)

    # Assert: the same line and column, by name, with the fix; the aggregator sees the cell, not "<path>"
    located = "line 5, column 'mean_radius': 'n/a' is not a number; write a number there, or remove the row"
    assert warning == f"--data {data}: {located}"
    assert public_reason(task_error.value) == f"DataError: {located}"


def test_a_restart_says_what_the_supernode_logged_last(tmp_path: Path) -> None:
    # Prepare: a SuperNode that died on an error of its own (no refused key)
    logs = tmp_path / "agent" / "logs"
    logs.mkdir(parents=True)
    (logs / "supernode.log").write_text("")
    said: list[str] = []
    console = AgentConsole(logs, "ward-7", said.append)
    with (logs / "supernode.log").open("a") as out:
        out.write("INFO :      Starting Flower SuperNode\n2026-01-02 10:00:00 ERROR :   Disk quota exceeded: "
                  "/var/lib/x\nINFO :      bye\n")
    # Execute
    assert console.after_exit("supernode", 1, 1, None, 2.0) is None
    # Assert
    assert said[-1].startswith("supernode exited (rc 1): Disk quota exceeded: /var/lib/x; restarting in 2 s")
