"""Deployment runtime: a real SuperLink, two SuperNodes and ``flwr run`` on loopback.

The repository root is the Flower App (``[tool.flwr.app]`` in pyproject.toml);
``flwr run`` bundles it into a FAB, the SuperLink's SuperExec starts the
ServerApp (``aggregator.serverapp:app``) and each SuperNode's SuperExec starts
a ``flwr-clientapp`` process per message. Two rounds of a tiny scenario take
about a minute on an idle 2-core machine, most of it Flower's polling
(SuperNode: 3 s when idle) and one fresh ClientApp process per message.

The same SuperLink and SuperNodes then run a user's own Flower app
(``tests/runtimes/flower_quickstart``: a stock quickstart ClientApp, its
pyproject pointing ``serverapp`` at Quorum's) on the same scenario, which must
reach the accuracy Quorum's own client reached (issue 11).
"""

from __future__ import annotations

import re
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from aggregator.store import Run, RunStore
from tests.conftest import REPO, wait_for
from tests.runtimes.processes import VENV_BIN, Processes, Started, free_ports

RUN_CONFIG_KEYS = ("scenario", "db")  # what this test passes with --run-config

SCENARIO = """
name = "deployment-test"
seed = 5
rounds = 2
[data]
dataset = "digits"
partition = "iid"
[model]
name = "mlp"                     # the quickstart app's Net: McMahan's 2NN
[federation]
clients = 2
fraction = 1.0
min_clients = 2
deadline_s = 90.0
[training]
local_epochs = 1
batch_size = 32
lr = 0.1
[evaluation]
federated = true
server = true
every = 2                        # federated evaluation in the last round only: one message less
"""

FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2",  # SuperExec looks for new tasks every 0.2 s, not 1 s
}
START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 240.0
STOCK_APP = REPO / "tests" / "runtimes" / "flower_quickstart"
SLOW_APP = REPO / "tests" / "runtimes" / "slow_app"  # Quorum's ClientApp; `delay-s` in a node's config slows it
SLOW_DELAY_S = 8.0

ASYNC_SCENARIO = """
name = "deployment-async"
seed = 5
rounds = 2                       # server steps: two fast replies, then the slow one and a fast one
[data]
dataset = "digits"
partition = "iid"
[model]
name = "logreg"
[federation]
clients = 3
deadline_s = 120.0
[training]
local_epochs = 1
batch_size = 32
lr = 0.1
[evaluation]
federated = false
server = true
[async]
enabled = true
clock = "wall"                   # real time on a deployment
concurrency = 3
buffer_size = 2
max_staleness = 10
"""


def test_a_round_on_a_superlink_with_two_supernodes(processes: Processes, tmp_path: Path) -> None:
    # Prepare: one round with federated evaluation (rounds over a SuperLink are the deploy tests' subject)
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(SCENARIO.replace("rounds = 2", "rounds = 1").replace("every = 2 ", "every = 1 "))
    t0 = time.monotonic()
    env, _ = _federation(processes, tmp_path, "", ["partition-id=0 num-partitions=2",
                                                   "partition-id=1 num-partitions=2"])
    t_up = time.monotonic()

    # Execute: Quorum's app, then a user's stock Flower ClientApp under Quorum's ServerApp
    quorum = _flwr_run(processes, "flwr-run", REPO, scenario, tmp_path / "quorum.db", env)
    t_quorum = time.monotonic()
    stock = _flwr_run(processes, "flwr-run-stock", STOCK_APP, scenario, tmp_path / "stock.db", env)
    t_done = time.monotonic()

    # Assert: both finished the round with every client's update, to the same accuracy
    for store, stored in (quorum, stock):
        assert (stored.status, stored.rounds_done) == ("finished", 1), \
            f"{stored.status}: {stored.error}\n{processes.logs()}"
        rounds = store.rounds(stored.id)
        assert [r.round for r in rounds] == [1]
        for r in rounds:
            results = store.client_results(stored.id, r.round)
            assert [c.outcome for c in results] == ["ok", "ok"], [(c.client, c.outcome, c.reason) for c in results]
        assert rounds[-1].server_accuracy is not None
    accuracy = {name: store.rounds(stored.id)[-1].server_accuracy
                for name, (store, stored) in (("quorum", quorum), ("stock", stock))}
    assert accuracy["stock"] == pytest.approx(accuracy["quorum"], abs=0.01), accuracy
    assert accuracy["quorum"] > 0.2  # one round of one epoch: past chance (0.1); node ids seed the shuffle
    # Federated evaluation has the round loop's fixed 30 s deadline: on a loaded machine a
    # fresh ClientApp process may miss it, which is data (a late client), not a failure.
    print(f"deployment: up in {t_up - t0:.1f} s, 2 clients x 1 round in {t_quorum - t_up:.1f} s "
          f"(flwr run: FAB build to exit), the stock app in {t_done - t_quorum:.1f} s; "
          f"server accuracy {accuracy}")


def test_a_stock_flower_clientapp_runs_on_flowers_ray_simulation_under_quorums_serverapp(
        processes: Processes, tmp_path: Path) -> None:
    # Prepare: a simulation SuperLink (Flower's Ray runtime), no dependency installation
    pytest.importorskip("ray", reason="Flower's simulation runtime needs quorum[simulation]")
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(SCENARIO)
    (link_port,) = free_ports(1)
    env = {**FLOWER_ENV, "FLWR_HOME": str(_flower_home(tmp_path, link_port)), "RAY_USAGE_STATS_ENABLED": "0"}
    link = processes.start("superlink-simulation", [
        str(VENV_BIN / "flower-superlink"), "--simulation", "--insecure", "--host", "127.0.0.1",
        "--port", str(link_port), "--disable-runtime-dependency-installation"], env)
    _wait_healthy(link, link_port, processes)

    # Execute: the user's app, two virtual SuperNodes on Ray
    store, stored = _flwr_run(processes, "flwr-run-ray", STOCK_APP, scenario, tmp_path / "ray.db", env,
                              "--federation-config", "num-supernodes=2")

    # Assert: every client's update in both rounds; the model learned
    assert (stored.status, stored.rounds_done) == ("finished", 2), f"{stored.status}: {stored.error}"
    rounds = store.rounds(stored.id)
    assert [r.answered for r in rounds] == [2, 2]
    assert all(c.outcome == "ok" for r in rounds for c in store.client_results(stored.id, r.round))
    assert rounds[-1].server_accuracy > 0.3  # past chance (0.1): node ids, random here, seed the training


def test_fedbuff_in_wall_time_on_a_superlink_steps_past_a_slow_supernode(processes: Processes,
                                                                          tmp_path: Path) -> None:
    # Prepare: three SuperNodes, the third 8 s slower to train (issue 15)
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(ASYNC_SCENARIO)
    delays = [0.0, 0.0, SLOW_DELAY_S]
    env, nodes = _federation(processes, tmp_path, "-async",
                             [f"partition-id={i} num-partitions=3 delay-s={d}" for i, d in enumerate(delays)])
    slow_id = re.search(r"SuperNode ID: (\d+)", nodes[2].log.read_text(errors="replace"))[1]

    # Execute
    store, stored = _flwr_run(processes, "flwr-run-async", SLOW_APP, scenario, tmp_path / "async.db", env)

    # Assert: two steps of two replies in wall time; a step was applied while the slow node trained,
    # and its reply, when it came, was folded in stale with the weight 1 / sqrt(1 + staleness)
    assert (stored.status, stored.rounds_done) == ("finished", 2), f"{stored.status}: {stored.error}"
    rows = store.rounds(stored.id)
    folded = [(r.round, c) for r in rows for c in store.client_results(stored.id, r.round) if c.outcome == "ok"]
    assert all(sum(r.metrics["staleness-counts"]) == 2 for r in rows)
    slow = [(step, c) for step, c in folded if c.client == slow_id]
    assert slow, (slow_id, [(step, c.client, c.metrics) for step, c in folded])
    step, reply = slow[0]
    # a step was applied while it trained: its first reply is stale, and folded after that step
    assert step >= 2 and reply.metrics["staleness"] >= 1 and reply.metrics["wall-duration-s"] >= SLOW_DELAY_S
    assert reply.metrics["discount"] == pytest.approx(1 / (1 + reply.metrics["staleness"]) ** 0.5)
    assert step - 1 >= reply.metrics["staleness"]  # the steps between its dispatch and its fold
    times = [r.metrics["wall-time-s"] for r in rows]
    assert times == sorted(times) and times[-1] >= SLOW_DELAY_S
    assert rows[-1].server_accuracy is not None


def _federation(processes: Processes, tmp_path: Path, suffix: str,
                node_configs: list[str]) -> tuple[dict[str, str], list[Started]]:
    """A SuperLink and one SuperNode per node config, on loopback, once all are up: the env and the nodes."""
    link_port, *node_ports = free_ports(1 + len(node_configs))
    env = {**FLOWER_ENV, "FLWR_HOME": str(_flower_home(tmp_path, link_port))}
    link = processes.start(f"superlink{suffix}", [
        str(VENV_BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(link_port),
        "--disable-runtime-dependency-installation"], env)
    _wait_healthy(link, link_port, processes)
    nodes = [processes.start(f"supernode{suffix}-{i}", [
        str(VENV_BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
        "--port", str(port), "--node-config", config], env)
        for i, (port, config) in enumerate(zip(node_ports, node_configs, strict=True))]
    for node in nodes:
        _wait_for_log(node, "SuperNode ID:", processes)
    return env, nodes


def _flwr_run(processes: Processes, name: str, app: Path, scenario: Path, db_path: Path,
              env: dict[str, str], *extra: str) -> tuple[RunStore, Run]:
    """``flwr run APP --stream`` on the SuperLink; the one run it stored, once it ended."""
    _require_run_config_keys(app)
    db = f"sqlite:///{db_path}"
    run = processes.start(name, [
        str(VENV_BIN / "flwr"), "run", str(app), "local-test", "--stream",
        "--run-config", f'scenario="{scenario}" db="{db}"', *extra], env)
    try:
        rc = run.popen.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not finish in {RUN_TIMEOUT_S:g} s\n{processes.logs()}")
    assert rc == 0, f"{name} failed (rc {rc})\n{processes.logs()}"
    store = RunStore(db)
    runs = store.list_runs()
    assert len(runs) == 1, f"expected one run in the store, found {len(runs)}\n{processes.logs()}"
    return store, _wait_finished(store, runs[0].id)


def _require_run_config_keys(app: Path) -> None:
    """``flwr run --run-config`` accepts only keys the app's pyproject declares."""
    config = tomllib.loads((app / "pyproject.toml").read_text())
    declared = config.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    missing = [k for k in RUN_CONFIG_KEYS if k not in declared]
    if missing:
        pytest.fail(f"{app}/pyproject.toml [tool.flwr.app.config] must declare {missing} (e.g. db = \"\"): "
                    "Flower rejects --run-config keys the app does not declare")


def _flower_home(tmp_path: Path, port: int) -> Path:
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local-test"\n\n'
        f'[superlink.local-test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    return home


def _wait_healthy(link: Started, port: int, processes: Processes) -> None:
    """Until the SuperLink answers ``/health`` (an open port is not enough: start-up continues)."""
    def healthy() -> bool:
        if link.popen.poll() is not None:
            pytest.fail(f"the SuperLink exited with rc {link.popen.returncode}\n{processes.logs()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    wait_for(healthy, START_TIMEOUT_S, lambda: f"the SuperLink to be healthy\n{processes.logs()}", poll_s=0.2)


def _wait_for_log(started: Started, text: str, processes: Processes) -> None:
    def logged() -> bool:
        if started.popen.poll() is not None:
            pytest.fail(f"{started.name} exited with rc {started.popen.returncode}\n{processes.logs()}")
        return text in started.log.read_text(errors="replace")

    wait_for(logged, START_TIMEOUT_S, lambda: f"{started.name} to log {text!r}\n{processes.logs()}", poll_s=0.2)


def _wait_finished(store: RunStore, run_id: str, timeout_s: float = 30.0) -> Run:
    """The run row once it leaves ``running`` (``flwr run --stream`` may return a moment early)."""
    def ended() -> Run | None:
        run = store.get_run(run_id)
        return run if run.status != "running" else None

    return wait_for(ended, timeout_s, f"run {run_id} to leave 'running'", poll_s=0.2)
