"""Which process holds a port, and a supervised child stopped with its whole group (an nginx master's workers)."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from deploy.ports import describe_holders, port_free, port_holders, wait_port_free
from deploy.supervisor import _Child
from tests.conftest import wait_for

pytestmark = pytest.mark.e2e  # real sockets and processes

#: A parent that starts a child listening on a free loopback port (printed), then both sleep: an nginx master
#: and its worker.
MASTER = ("import subprocess, sys, time\n"
          "worker = ('import socket, time\\ns = socket.socket()\\ns.bind((\"127.0.0.1\", 0))\\ns.listen()\\n'\n"
          "          'print(s.getsockname()[1], flush=True)\\ntime.sleep(120)\\n')\n"
          "subprocess.Popen([sys.executable, '-c', worker])\n"
          "time.sleep(120)\n")


def test_a_listening_socket_is_named_by_its_process_and_freed_when_closed() -> None:
    # Prepare: this process listens on a free loopback port
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        # Execute
        holders = port_holders(port)

        # Assert: held, by this very process, named with its command line
        assert not port_free("127.0.0.1", port)
        assert [pid for pid, _ in holders] == [os.getpid()]
        assert describe_holders(port).startswith(f"held by pid {os.getpid()} (")
        assert not wait_port_free("127.0.0.1", port, 0.3)
    assert port_free("127.0.0.1", port) and port_holders(port) == []


def test_a_childs_whole_group_is_stopped_its_orphaned_worker_included(tmp_path: Path) -> None:
    # Prepare: the "master" is killed alone; its "worker" still holds the port
    log = tmp_path / "child.log"
    child = _Child("toy", [sys.executable, "-c", MASTER], dict(os.environ), log)
    child.start()
    try:
        port = wait_for(lambda: int(log.read_text().split()[0]) if log.read_text().strip() else None, 30,
                        "the worker to listen", poll_s=0.05)
        assert child.proc is not None
        child.proc.kill()
        child.proc.wait(timeout=10)
        assert not port_free("127.0.0.1", port) and port_holders(port), "the orphaned worker should listen"

        # Execute: what the supervisor does before it restarts a child
        child.signal_group(signal.SIGKILL)

        # Assert: the worker went with its group, and the port is free for the new master
        assert wait_port_free("127.0.0.1", port, 10.0)
    finally:
        child.stop(1.0)


#: Stand-ins whose command lines read as a ServerApp and as a running aggregator (what the checks look at).
SERVERAPP = [sys.executable, "-c", "import signal; signal.pause()", "flwr-serverapp"]
AGGREGATOR = [sys.executable, "-c", "import signal; signal.pause()", "quorum", "aggregator", "start"]


@pytest.mark.parametrize("leader", ["dead", "alive"])
def test_a_standby_stops_its_hosts_leftover_serverapps_before_it_waits_unless_its_aggregator_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leader: str) -> None:
    import json
    import subprocess

    from deploy.config import load_config
    from deploy.supervisor import Supervisor

    # Prepare: this host's state folder, a ServerApp it left (recorded as Flower's wrapper records it), and
    # its pid file naming an aggregator that is gone (killed) or still runs
    path = tmp_path / "federation.toml"
    path.write_text('[aggregator]\nstate_dir = "st"\n')
    cfg = load_config(path)
    (cfg.state.root / "serverapps").mkdir(parents=True)
    procs = [subprocess.Popen(SERVERAPP)]
    if leader == "alive":
        procs.append(subprocess.Popen(AGGREGATOR))
    try:
        for p in procs:  # until each has exec'd: a child just forked still shows pytest's command line
            wait_for(lambda p=p: b"signal.pause" in Path(f"/proc/{p.pid}/cmdline").read_bytes(), 10,
                     f"stand-in {p.pid} to start")
        (cfg.state.root / "serverapps" / f"{procs[0].pid}.json").write_text(json.dumps({"pid": procs[0].pid}))
        cfg.state.pidfile.write_text(json.dumps({"pid": procs[-1].pid if leader == "alive" else 2**22 + 7}))
        warmed: list[bool] = []
        monkeypatch.setattr("deploy.supervisor.warm_up", lambda: warmed.append(True))
        said: list[str] = []

        # Execute
        Supervisor(cfg, say=said.append, standby=True)._clear_for_standby()

        # Assert: stopped (SIGTERM, within the grace) only when this folder's aggregator is not running
        if leader == "dead":
            assert procs[0].wait(timeout=15) == -signal.SIGTERM
            assert said == [f"standby: stopped 1 ServerApp process(es) this host left when it led: [{procs[0].pid}]"]
        else:
            assert procs[0].poll() is None and said == []
        assert warmed == [True]
    finally:
        for p in procs:
            p.kill()
            p.wait()
