"""``simulate(engine="ray")``: the same ServerApp and ClientApp on Flower's Ray simulation.

Ray runs in a child process (a Ray driver is process-global state, and its
start-up output does not belong in pytest's), tagged so that every process
it leaves behind is found by PID.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runstore.store import RunStore
from runtimes.simulation import simulate
from tests.conftest import REPO, tiny_scenario
from tests.runtimes.processes import Processes, describe

pytestmark = [pytest.mark.e2e, pytest.mark.heavy]  # real processes (docs/testing.md)

pytest.importorskip("ray", reason="the Ray engine needs quorum[simulation]")

# SCAFFOLD: each client's control variate lives in its node state (context.state) from one round to the next;
# were Ray's node state lost between rounds, round 2 would train with c_i = 0 and differ from in-process
SCENARIO = {"federation": {"clients": 4, "fraction": 1.0, "min_clients": 2, "deadline_s": 60.0},
            "strategy": {"name": "scaffold"}}

RUN_ON_RAY = textwrap.dedent("""
    import json, sys
    from runtimes.simulation import simulate
    from tests.conftest import tiny_scenario
    summary = simulate(tiny_scenario(**json.loads(sys.argv[1])), db_url=sys.argv[2], engine="ray")
    print("SUMMARY " + json.dumps(summary.to_json()), flush=True)
""")


def test_ray_engine_runs_every_round_computes_what_inprocess_computes_and_cleans_up(
        processes: Processes, tmp_path: Path) -> None:
    # Prepare
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    started_at = time.monotonic()

    # Execute
    argv = [sys.executable, "-c", RUN_ON_RAY, json.dumps(SCENARIO), db]
    child = processes.start("ray-driver", argv, cwd=REPO)
    local_db = f"sqlite:///{tmp_path / 'local.db'}"  # in-process, in a store of its own, while Ray runs
    local = simulate(tiny_scenario(**SCENARIO), db_url=local_db, engine="inprocess", workers=1)
    try:
        rc = child.popen.wait(timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Ray run did not finish in 150 s\n{processes.logs()}")
    wall_s = time.monotonic() - started_at
    leftovers = processes.alive()  # before teardown: run_on_ray must clean up by itself

    # Assert: the run is stored, round by round, and Ray is gone
    assert rc == 0, f"the Ray run failed (rc {rc})\n{processes.logs()}"
    assert not leftovers, f"Ray processes outlived run_on_ray:\n{describe(leftovers)}"
    line = next((x for x in child.log.read_text().splitlines() if x.startswith("SUMMARY ")), None)
    assert line is not None, f"no summary printed\n{processes.logs()}"
    store = RunStore(db)
    run = store.get_run(json.loads(line[len("SUMMARY "):])["run_id"])
    assert (run.status, run.engine, run.rounds_done, run.strategy) == ("finished", "ray", 2, "scaffold")
    rounds = store.rounds(run.id)
    assert [r.round for r in rounds] == [1, 2]
    for r in rounds:
        results = store.client_results(run.id, r.round)
        answered = sorted(int(c.client) for c in results if c.outcome == "ok")
        # partition-id + 1 names a node, exactly as in-process
        assert answered == [1, 2, 3, 4], [(c.client, c.outcome, c.reason) for c in results]

    # Assert: same clients, same seeds, same numbers as in-process (sums differ only in order)
    for a, b in zip(rounds, RunStore(local_db).rounds(local.run_id), strict=True):
        assert a.server_accuracy == pytest.approx(b.server_accuracy, abs=1e-6)
        assert a.server_loss == pytest.approx(b.server_loss, rel=1e-5)
        assert a.fed_loss == pytest.approx(b.fed_loss, rel=1e-5)
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-5)
    print(f"ray engine: 4 clients x 2 rounds in {wall_s:.1f} s (child process, imports included)")


def test_a_tree_of_edges_on_ray_ends_with_the_flat_in_process_model(processes: Processes, tmp_path: Path) -> None:
    # Prepare: 6 devices under 2 edges on Ray (one edge at a time: its grid is not thread-safe), flat in-process
    tree = {"federation": {"clients": 6, "min_clients": 1, "weighting": "capped", "accumulate": "float64"},
            "hierarchy": {"edges": 2}}
    flat = {"federation": tree["federation"]}
    db = f"sqlite:///{tmp_path / 'runs.db'}"

    # Execute
    child = processes.start("ray-driver", [sys.executable, "-c", RUN_ON_RAY, json.dumps(tree), db], cwd=REPO)
    local_db = f"sqlite:///{tmp_path / 'local.db'}"
    local = simulate(tiny_scenario(**flat), db_url=local_db, engine="inprocess", workers=1)
    try:
        rc = child.popen.wait(timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the Ray run did not finish in 150 s\n{processes.logs()}")

    # Assert: the tree's rounds went through both edges, and its model is the flat one
    assert rc == 0, f"the Ray run failed (rc {rc})\n{processes.logs()}"
    line = next(x for x in child.log.read_text().splitlines() if x.startswith("SUMMARY "))
    run_id = json.loads(line[len("SUMMARY "):])["run_id"]
    store = RunStore(db)
    assert [[e["answered"] for e in r.tree["edges"]] for r in store.rounds(run_id)] == [[3, 3], [3, 3]]
    on_ray, here = store.load_state(run_id), RunStore(local_db).load_state(local.run_id)
    assert on_ray is not None and here is not None
    assert float(abs(on_ray.params - here.params).max()) <= 1e-6
