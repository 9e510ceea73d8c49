"""``--ray-address``: the Ray engine joins a running Ray cluster of two nodes on loopback.

Two ``ray start --block`` processes (a head and a second node, one CPU each)
form the cluster, started like every other process of the runtime tests: in
a session of their own, tagged, stopped by PID (never ``ray stop``, which
stops every Ray on the machine by name). The run joins the cluster, Flower
sizes its actor pool from both nodes' CPUs, and the scenario gives the model
the in-process runtime gives for the same seed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from runstore.store import RunStore
from runtimes.simulation import simulate
from tests.conftest import REPO, tiny_scenario, wait_for
from tests.runtimes.processes import VENV_BIN, Processes, free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.heavy]  # real processes (docs/testing.md)

pytest.importorskip("ray", reason="the Ray engine needs quorum[simulation]")

SCENARIO = {"federation": {"clients": 4, "fraction": 1.0, "min_clients": 2, "deadline_s": 60.0}}

# Imports first (while the cluster starts), then the run once the second node has joined; the
# cluster's nodes are read from inside the run (Flower's own connection), as it starts.
DRIVER = textwrap.dedent("""
    import json, pathlib, sys, time
    import ray
    from runtimes.simulation import simulate
    from tests.conftest import tiny_scenario
    address, node_log = sys.argv[3], pathlib.Path(sys.argv[4])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (
            node_log.exists() and "Ray runtime started" in node_log.read_text(errors="replace")):
        time.sleep(0.1)

    def nodes(run_id):
        alive = [n for n in ray.nodes() if n["Alive"]]
        print("NODES " + json.dumps([n["Resources"].get("CPU", 0) for n in alive]), flush=True)

    summary = simulate(tiny_scenario(**json.loads(sys.argv[1])), db_url=sys.argv[2], engine="ray",
                       ray_address=address, on_start=nodes)
    print("SUMMARY " + json.dumps(summary.to_json()), flush=True)
""")


@pytest.fixture
def ray_temp() -> Iterator[Path]:
    # Ray's socket paths must stay under 107 bytes: a short folder of its own, not pytest's tmp_path
    folder = Path(tempfile.mkdtemp(prefix="qray-", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_run_joins_a_two_node_ray_cluster_and_computes_what_inprocess_computes(
        processes: Processes, ray_temp: Path, tmp_path: Path) -> None:
    # Prepare: a head and a second node on loopback, one CPU each
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    ray = str(VENV_BIN / "ray")
    common = ["--block", "--num-cpus=1", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    head = processes.start("ray-head", [ray, "start", "--head", f"--port={port}", "--include-dashboard=false",
                                        f"--temp-dir={ray_temp}", *common])
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    node_log = tmp_path / "ray-node.log"
    driver = processes.start("ray-driver", [sys.executable, "-c", DRIVER, json.dumps(SCENARIO), db, address,
                                            str(node_log)], cwd=REPO)  # imports while the cluster starts
    wait_for(lambda: "Ray runtime started" in head.text() or head.popen.poll() is not None, 90,
             lambda: f"the Ray head\n{processes.logs()}")
    assert processes.start("ray-node", [ray, "start", f"--address={address}", *common]).log == node_log
    local_db = f"sqlite:///{tmp_path / 'local.db'}"  # in-process, in a store of its own, while Ray runs
    local = simulate(tiny_scenario(**SCENARIO), db_url=local_db, engine="inprocess", workers=1)

    # Execute
    try:
        rc = driver.popen.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the run on the cluster did not finish in 240 s\n{processes.logs()}")
    finally:
        processes.stop_all(grace_s=3.0)  # nothing of the cluster is worth 15 s of graceful shutdown

    # Assert: the cluster had two nodes of one CPU; the run finished there, every client answering
    assert rc == 0, f"the run on the cluster failed (rc {rc})\n{processes.logs()}"
    lines = driver.text().splitlines()
    nodes = json.loads(next(x for x in lines if x.startswith("NODES "))[len("NODES "):])
    assert nodes == [1.0, 1.0]
    summary = json.loads(next(x for x in lines if x.startswith("SUMMARY "))[len("SUMMARY "):])
    store = RunStore(db)
    run = store.get_run(summary["run_id"])
    assert (run.status, run.engine, run.rounds_done) == ("finished", "ray", 2)
    for r in store.rounds(run.id):
        assert sorted(int(c.client) for c in store.client_results(run.id, r.round) if c.outcome == "ok") == [1, 2, 3, 4]

    # Assert: the same numbers as in-process for the same seed (sums differ only in order)
    for a, b in zip(store.rounds(run.id), RunStore(local_db).rounds(local.run_id), strict=True):
        assert a.server_loss == pytest.approx(b.server_loss, rel=1e-5)
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-5)
        assert a.fed_loss == pytest.approx(b.fed_loss, rel=1e-5)
