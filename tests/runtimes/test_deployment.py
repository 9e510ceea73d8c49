"""Deployment runtime: a real SuperLink, two SuperNodes and ``flwr run`` on loopback.

The repository root is the Flower App (``[tool.flwr.app]`` in pyproject.toml);
``flwr run`` bundles it into a FAB, the SuperLink's SuperExec starts the
ServerApp (``aggregator.serverapp:app``) and each SuperNode's SuperExec starts
a ``flwr-clientapp`` process per message. A round over a SuperLink
costs seconds, most of it Flower's polling and one fresh ClientApp process per
message; the SuperNodes here poll every 0.5 s when idle (Flower's own SuperNode
through the agent's launcher, ``deploy.agent supernode --poll-s``), not 3 s.

The same SuperLink and SuperNodes then run Flower's official quickstart-pytorch
(``tests/flower_examples/quickstart-pytorch``: the example unchanged but for its
data loading, its pyproject's ``serverapp`` pointing at Quorum's) with no Quorum
scenario at all: the model, the learning rate and the rounds are the app's own
(issue 33), its run lands in the fleet's ``QUORUM_DB``, and ``flwr run --stream``
shows Quorum's round lines.

The module's SuperLinks and SuperNodes are shared by its tests (``fleet``):
each federation (its node configs differ) is started when the first test that
needs it runs and stopped by PID once the last one has run, where nothing of it
may outlive it; each test runs in a store of its own. An idle federation is not
free: a SuperLink and two SuperNodes polling each other every 0.2 s kept 18 %
of a core busy (8 % at 0.5 s), which the e2e tier, CPU-bound on two cores,
takes from every other test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from runstore.store import Run, RunStore
from tests.conftest import REPO, wait_for
from tests.runtimes.processes import VENV_BIN, Processes, Started, describe, free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.heavy]  # real processes (docs/testing.md)

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
local_epochs = 2                 # one epoch of one round can end at 0.21 (seed 1, in-process): two reach 0.54+
batch_size = 32
lr = 0.1
[evaluation]
federated = true
server = true
every = 2                        # federated evaluation in the last round only: one message less
"""

#: How often the fleet's SuperNodes and SuperExecs poll when idle: each message waits up to this long to be
#: pulled (Flower's default is 3 s), and an idle federation costs CPU in proportion (see the module's docstring).
POLL_S = 0.5
FLOWER_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(POLL_S),  # SuperExec looks for new tasks every 0.5 s, not 1 s
}
# Flower's own SuperNode (``flower-supernode``'s entry point, its default subprocess isolation: a fresh
# ``flwr-clientapp`` per message), run by the agent's launcher with the idle poll at POLL_S instead of the
# hard-coded 3 s. Each message otherwise waited up to 3 s to be pulled and up to 3 s more for its reply
# to be pushed: 20-30 s of this module's sleeping, and not what it tests.
SUPERNODE = (sys.executable, "-m", "deploy.agent", "supernode", "--poll-s", str(POLL_S), "--")
START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 240.0
STOCK_APP = REPO / "tests" / "runtimes" / "flower_quickstart"
EXAMPLES = REPO / "tests" / "flower_examples"  # Flower's official examples, their data loading local
PYTORCH_EXAMPLE = EXAMPLES / "quickstart-pytorch"
SLOW_APP = REPO / "tests" / "runtimes" / "slow_app"  # Quorum's ClientApp; `delay-s` in a node's config slows it
# The slow node's reply comes D s after a fast one's, t after its task (t: a ClientApp process's start and
# training, 5-6 s alone, about 10 s under the e2e tier's load). Step k folds the first two replies after step
# k-1, so the slow reply is in one of the first three steps whenever t + D < 3t, i.e. t > D / 2; and it is not
# in the first unless a fast reply comes D s late. With D = 8 and two steps it needed t > 8 s: it passed under
# load and failed alone. D = 6 and three steps: t > 3 s, and 6 s of slack for a late fast reply.
SLOW_DELAY_S = 6.0

# The module's fleet: the SuperNodes' node configs of each federation (None: a simulation SuperLink, Ray)
FLEET: dict[str, tuple[str, ...] | None] = {
    "sync_federation": ("partition-id=0 num-partitions=2", "partition-id=1 num-partitions=2"),
    # the third node SLOW_DELAY_S slower (issue 15)
    "async_federation": tuple(f"partition-id={i} num-partitions=3 delay-s={d}"
                              for i, d in enumerate((0.0, 0.0, SLOW_DELAY_S))),
    "simulation_link": None,
}

ASYNC_SCENARIO = """
name = "deployment-async"
seed = 5
rounds = 3                       # server steps of two replies: the slow one is in one of them
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


def test_a_round_on_a_superlink_with_two_supernodes(processes: Processes, fleet: Fleet, quorum_app: Path,
                                                     sync_federation: Federation, tmp_path: Path) -> None:
    # Prepare: one round with federated evaluation (rounds over a SuperLink are the deploy tests' subject)
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(SCENARIO.replace("rounds = 2", "rounds = 1").replace("every = 2 ", "every = 1 "))
    env, logs = sync_federation.env, _logs(processes, fleet)
    t0 = time.monotonic()

    # Execute: Quorum's app, then Flower's official quickstart-pytorch under Quorum's ServerApp, with its own
    # run config but one round (one after the other: at the same time, a node's second message waits out the
    # first's ClientApp process, which on a loaded machine pushes it past the 90 s deadline)
    quorum = _flwr_run(processes, "flwr-run", quorum_app, scenario, tmp_path / "quorum.db", env, logs)
    t_quorum = time.monotonic()
    example, example_run = _flwr_run_app(processes, "flwr-run-pytorch-example", _copy(PYTORCH_EXAMPLE, tmp_path),
                                         env, logs, "num-server-rounds=1")
    t_done = time.monotonic()

    # Assert: both finished the round with every client's update
    for store, stored in (quorum, (example, example_run)):
        assert (stored.status, stored.rounds_done) == ("finished", 1), \
            f"{stored.status}: {stored.error}\n{logs()}"
        rounds = store.rounds(stored.id)
        assert [r.round for r in rounds] == [1]
        results = store.client_results(stored.id, 1)
        assert [c.outcome for c in results] == ["ok", "ok"], [(c.client, c.outcome, c.reason) for c in results]
    accuracy = quorum[0].rounds(quorum[1].id)[-1].server_accuracy
    assert accuracy is not None and accuracy > 0.3  # one round of two epochs: well past chance (0.1)
    # the example's own model (its Net, from its server_app.py) and its round line in `flwr run --stream`
    assert "pytorchexample.server_app:app" in example_run.info["model"]
    assert "[quorum] round 1/1: " in example_run_log(processes, "flwr-run-pytorch-example"), logs()
    # Federated evaluation has the round loop's fixed 30 s deadline: on a loaded machine a fresh ClientApp
    # process may miss it, which is data (a late client), not a failure.
    fed = example.rounds(example_run.id)[-1].fed_accuracy
    print(f"deployment: 2 clients x 1 round in {t_quorum - t0:.1f} s (flwr run: FAB build to exit), "
          f"quickstart-pytorch in {t_done - t_quorum:.1f} s; server accuracy {accuracy}, the example's "
          f"federated accuracy {fed}")


def test_flowers_sklearn_and_numpy_quickstarts_run_on_a_superlink_under_quorums_serverapp(
        processes: Processes, fleet: Fleet, sync_federation: Federation, tmp_path: Path) -> None:
    # Prepare: the two official examples as tests/flower_examples holds them (pyproject's serverapp: Quorum's),
    # one round each on the fleet's two SuperNodes (their node configs: partition-id 0 and 1 of 2)
    env, logs = sync_federation.env, _logs(processes, fleet)

    for folder, package in (("quickstart-sklearn", "sklearnexample"), ("quickstart-numpy", "quickstart_numpy")):
        # Execute: `flwr run --stream` with the app's own run config, one round
        name = f"flwr-run-{folder}"
        store, run = _flwr_run_app(processes, name, _copy(EXAMPLES / folder, tmp_path), env, logs,
                                   "num-server-rounds=1")

        # Assert: both nodes answered both stages with the app's own arrays (float64, scikit-learn's coef_ in
        # Fortran order) and metrics; the model came from the app's own ServerApp; the round line was streamed
        assert (run.status, run.rounds_done) == ("finished", 1), f"{folder}: {run.status}: {run.error}\n{logs()}"
        assert [c.outcome for c in store.client_results(run.id, 1)] == ["ok", "ok"]
        assert f"{package}.server_app:app" in run.info["model"]
        streamed = example_run_log(processes, name)
        assert re.search(r"\[quorum\] round 1/1: .*clients 2/2 answered", streamed), streamed
        row = store.rounds(run.id)[-1]
        if package == "sklearnexample":  # its evaluate reply's accuracy, and test_logloss read as the loss
            assert row.fed_accuracy is not None and row.fed_loss is not None, row.metrics


#: The other way round, per example: its package, the Quorum task of its training (quorum_task.py beside it), the
#: last key of its run config (the scenario-json key goes after it), and the [training] that carries its
#: ClientApp's own keys (local-epochs, batch-size).
REVERSE = {
    "quickstart-sklearn": ("sklearnexample", "SklearnExampleTask", 'penalty = "l2"', {}),
    "quickstart-pytorch": ("pytorchexample", "PytorchExampleTask", "batch-size = 32",
                           {"local_epochs": 1, "batch_size": 32}),
}


@pytest.mark.parametrize("example", sorted(REVERSE))
def test_quorums_clientapp_trains_an_example_on_a_superlink_under_the_examples_own_serverapp(
        processes: Processes, fleet: Fleet, sync_federation: Federation, tmp_path: Path, example: str) -> None:
    # Prepare: the example as a user moving it to Quorum's ClientApp writes it (docs/runtimes.md, "the other way
    # round"): its pyproject's serverapp its own, clientapp Quorum's, and a scenario-json key for the clients'
    # scenario, whose [task] is the example's training (quorum_task.py beside it); one round on two SuperNodes
    package, task, last_key, training = REVERSE[example]
    app = _copy(EXAMPLES / example, tmp_path)
    pyproject = (app / "pyproject.toml").read_text()
    pyproject = re.sub(r'serverapp = "aggregator.serverapp:app".*', f'serverapp = "{package}.server_app:app"',
                       pyproject)
    pyproject = pyproject.replace(f'clientapp = "{package}.client_app:app"', 'clientapp = "clients.clientapp:app"')
    (app / "pyproject.toml").write_text(pyproject.replace(last_key, f'{last_key}\nscenario-json = ""'))
    scenario = {"name": example, "federation": {"clients": 2}, "training": training,
                "task": {"entry": f"quorum_task:{task}", "path": str(app)}}
    run_config = tmp_path / "run-config.toml"
    run_config.write_text(f"scenario-json = {json.dumps(json.dumps(scenario))}\nnum-server-rounds = 1\n")

    # Execute
    run = processes.start(f"flwr-run-{example}-reverse", [str(VENV_BIN / "flwr"), "run", str(app), "local-test",
                                                          "--stream", "--run-config", str(run_config)],
                          sync_federation.env)
    rc = run.popen.wait(timeout=RUN_TIMEOUT_S)

    # Assert: Flower's FedAvg aggregated both nodes' replies in Flower's layout (eval_acc from the task's accuracy)
    streamed = run.log.read_text(errors="replace")
    assert rc == 0, f"{streamed[-3000:]}\n{_logs(processes, fleet)()}"
    assert streamed.count("Received 2 results and 0 failures") == 2, streamed[-3000:]
    assert re.search(r"Aggregated MetricRecord: \{'eval_loss': [0-9.e-]+, 'eval_acc': [0-9.]+\}", streamed), streamed
    assert "Saving final model to disk" in streamed  # the example's own ServerApp ran to its end
    if example == "quickstart-sklearn":  # one round of SAGA on Iris: well past chance (1/3)
        accuracy = re.search(r"'eval_acc': ([0-9.]+)\}", streamed)
        assert accuracy and float(accuracy[1]) > 0.6, streamed[-3000:]
    else:  # the example's own centralized evaluation: one round of its SGD lowered the test loss (a CNN's first
        # round moves it little, and its accuracy from a random start may still be at chance)
        losses = [float(x) for x in re.findall(r"'accuracy': [0-9.e-]+, 'loss': ([0-9.e-]+)\}", streamed)]
        assert len(losses) >= 2 and losses[1] < losses[0], streamed[-3000:]


def test_a_stock_flower_clientapp_runs_on_flowers_ray_simulation_under_quorums_serverapp(
        processes: Processes, fleet: Fleet, simulation_link: Federation, tmp_path: Path) -> None:
    # Prepare: a simulation SuperLink (Flower's Ray runtime), no dependency installation (the fleet's)
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(SCENARIO)

    # Execute: the user's app, two virtual SuperNodes on Ray
    store, stored = _flwr_run(processes, "flwr-run-ray", STOCK_APP, scenario, tmp_path / "ray.db",
                              simulation_link.env, _logs(processes, fleet), "--federation-config", "num-supernodes=2")

    # Assert: every client's update in both rounds; the model learned
    assert (stored.status, stored.rounds_done) == ("finished", 2), f"{stored.status}: {stored.error}"
    rounds = store.rounds(stored.id)
    assert [r.answered for r in rounds] == [2, 2]
    assert all(c.outcome == "ok" for r in rounds for c in store.client_results(stored.id, r.round))
    assert rounds[-1].server_accuracy > 0.3  # past chance (0.1): node ids, random here, seed the training


def test_fedbuff_in_wall_time_on_a_superlink_steps_past_a_slow_supernode(
        processes: Processes, fleet: Fleet, async_federation: Federation, tmp_path: Path) -> None:
    # Prepare: three SuperNodes, the third SLOW_DELAY_S slower to train (issue 15; the fleet's async federation)
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(ASYNC_SCENARIO)
    slow_id = re.search(r"SuperNode ID: (\d+)", async_federation.nodes[2].text())[1]

    # Execute
    store, stored = _flwr_run(processes, "flwr-run-async", SLOW_APP, scenario, tmp_path / "async.db",
                              async_federation.env, _logs(processes, fleet))

    # Assert: three steps of two replies in wall time; a step was applied while the slow node trained,
    # and its reply, when it came, was folded in stale with the weight 1 / sqrt(1 + staleness)
    assert (stored.status, stored.rounds_done) == ("finished", 3), f"{stored.status}: {stored.error}"
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


@dataclass
class Federation:
    """One SuperLink of the fleet and its SuperNodes; ``env`` is what ``flwr run`` against it needs."""

    procs: Processes
    link: Started
    port: int
    env: dict[str, str]
    nodes: list[Started] = field(default_factory=list)


@dataclass
class Fleet:
    """The module's SuperLinks and SuperNodes: each federation started for its first test, stopped after its last.

    ``last_user`` names, per federation, the last test of this session's selection that needs it.
    """

    workdir: Path
    last_user: dict[str, str]
    federations: dict[str, Federation] = field(default_factory=dict)

    def logs(self) -> str:
        return "\n\n".join(fed.procs.logs() for fed in self.federations.values())

    def ready(self, name: str) -> Federation:
        """The federation once its SuperLink is healthy and every SuperNode has its id (started if need be)."""
        if name not in self.federations:
            self.federations[name] = self._start(name)
        fed = self.federations[name]
        for node in fed.nodes:
            _wait_for_log(node, "SuperNode ID:", self.logs)
        return fed

    def _start(self, name: str) -> Federation:
        procs = Processes(workdir=self.workdir / name)
        procs.workdir.mkdir(parents=True)
        port, *node_ports = free_ports(1 + len(FLEET[name] or ()))
        env = {**FLOWER_ENV, "FLWR_HOME": str(_flower_home(procs.workdir, port)),
               # the store of a stock Flower app's run (its run config has no `db` key to pass one)
               "QUORUM_DB": f"sqlite:///{procs.workdir / 'flower-apps.db'}"}
        mode = ["--simulation"] if FLEET[name] is None else []
        if FLEET[name] is None:
            env["RAY_USAGE_STATS_ENABLED"] = "0"
        try:
            return self._start_processes(name, procs, port, node_ports, mode, env)
        except BaseException:  # a SuperLink that never became healthy, a SuperNode that would not start
            procs.stop_all()
            raise

    def _start_processes(self, name: str, procs: Processes, port: int, node_ports: list[int], mode: list[str],
                         env: dict[str, str]) -> Federation:
        link = procs.start(f"superlink-{name}", [
            str(VENV_BIN / "flower-superlink"), *mode, "--insecure", "--host", "127.0.0.1", "--port", str(port),
            "--disable-runtime-dependency-installation"], env)
        fed = Federation(procs, link, port, env)
        _wait_healthy(link, port, procs.logs)
        fed.nodes.extend(procs.start(f"supernode-{name}-{i}", [
            *SUPERNODE, "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(node_port),
            "--node-config", config], env) for i, (config, node_port) in enumerate(zip(FLEET[name] or (), node_ports,
                                                                                       strict=True)))
        return fed

    def done_with(self, test: str) -> None:
        """Stop, by PID, every federation whose last test was ``test``."""
        for name in [n for n, last in self.last_user.items() if last == test and n in self.federations]:
            self.stop(name)

    def stop(self, name: str) -> None:
        procs = self.federations.pop(name).procs
        procs.stop_all()
        left = procs.alive()
        assert not left, f"processes outlived the {name} federation:\n{describe(left)}"


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The federations the selected tests of this module ask for, each for as long as a test needs it."""
    last_user = {name: item.nodeid for item in request.session.items if getattr(item, "module", None) is request.module
                 for name in getattr(item, "fixturenames", ()) if name in FLEET}
    the_fleet = Fleet(tmp_path_factory.mktemp("fleet"), last_user)
    try:
        yield the_fleet
    finally:
        for name in list(the_fleet.federations):
            the_fleet.stop(name)


@pytest.fixture(autouse=True)
def _stop_what_no_later_test_needs(request: pytest.FixtureRequest, fleet: Fleet) -> Iterator[None]:
    yield
    fleet.done_with(request.node.nodeid)


@pytest.fixture(scope="module")
def sync_federation(fleet: Fleet) -> Federation:
    return fleet.ready("sync_federation")


@pytest.fixture(scope="module")
def async_federation(fleet: Fleet) -> Federation:
    return fleet.ready("async_federation")


@pytest.fixture(scope="module")
def simulation_link(fleet: Fleet) -> Federation:
    pytest.importorskip("ray", reason="Flower's simulation runtime needs quorum[simulation]")
    return fleet.ready("simulation_link")


@pytest.fixture(scope="module")
def quorum_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Quorum's Flower App (the repository root) without what its FAB leaves out anyway.

    ``flwr run`` walks and resolves every file under the app before it applies
    ``.gitignore``: in a checkout with its virtual environment that is some
    60,000 files (seconds of CPU, a minute on a loaded machine) for a FAB of a
    few hundred. The copy skips the folders Flower's own publish filter drops
    (``.venv``, caches, build output); ``flwr run`` builds the same FAB from it.
    """
    from flwr.cli.utils import filter_paths_for_publish

    dest = tmp_path_factory.mktemp("quorum-app")
    gitignore = (REPO / ".gitignore").read_bytes() if (REPO / ".gitignore").exists() else b""

    def dropped(folder: str) -> bool:
        probe = f"{folder}/probe.py"
        with warnings.catch_warnings():  # pathspec's deprecation of Flower's "gitwildmatch"
            warnings.simplefilter("ignore", DeprecationWarning)
            return probe not in filter_paths_for_publish({".gitignore": gitignore, probe: b""})

    for folder, subfolders, files in os.walk(REPO, followlinks=False):
        rel = Path(folder).relative_to(REPO)
        subfolders[:] = [d for d in subfolders if not dropped((rel / d).as_posix())]
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            if not (Path(folder) / name).is_symlink():  # Flower skips symlinks too
                shutil.copy2(Path(folder) / name, dest / rel / name)
    return dest


def _logs(processes: Processes, fleet: Fleet) -> Callable[[], str]:
    """The test's processes' logs, then the fleet's: for a failure message."""
    return lambda: f"{processes.logs()}\n\n{fleet.logs()}"


def _flwr_run(processes: Processes, name: str, app: Path, scenario: Path, db_path: Path, env: dict[str, str],
              logs: Callable[[], str], *extra: str) -> tuple[RunStore, Run]:
    """``flwr run APP --stream`` on the SuperLink; the one run it stored, once it ended."""
    _require_run_config_keys(app)
    db = f"sqlite:///{db_path}"
    run = processes.start(name, [
        str(VENV_BIN / "flwr"), "run", str(app), "local-test", "--stream",
        "--run-config", f'scenario="{scenario}" db="{db}"', *extra], env)
    try:
        rc = run.popen.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{run.name} did not finish in {RUN_TIMEOUT_S:g} s\n{logs()}")
    assert rc == 0, f"{run.name} failed (rc {rc})\n{logs()}"
    store = RunStore(db)
    runs = store.list_runs()
    assert len(runs) == 1, f"expected one run in the store, found {len(runs)}\n{logs()}"
    return store, _wait_finished(store, runs[0].id)


def _flwr_run_app(processes: Processes, name: str, app: Path, env: dict[str, str], logs: Callable[[], str],
                  run_config: str) -> tuple[RunStore, Run]:
    """``flwr run APP --stream`` of a stock Flower app (its own run-config keys only); its run, once it ended,
    from the fleet's ``QUORUM_DB``, where Quorum's ServerApp stores it."""
    run = processes.start(name, [str(VENV_BIN / "flwr"), "run", str(app), "local-test", "--stream",
                                 "--run-config", run_config], env)
    try:
        rc = run.popen.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{run.name} did not finish in {RUN_TIMEOUT_S:g} s\n{logs()}")
    assert rc == 0, f"{run.name} failed (rc {rc})\n{logs()}"
    store = RunStore(env["QUORUM_DB"])
    runs = [r for r in store.list_runs() if r.name == _project_name(app)]
    assert len(runs) == 1, f"expected one run of {app.name} in the store, found {len(runs)}\n{logs()}"
    return store, _wait_finished(store, runs[0].id)


def example_run_log(processes: Processes, name: str) -> str:
    """What ``flwr run --stream`` of an example printed (the ServerApp's log, streamed)."""
    return "\n".join(p.log.read_text(errors="replace") for p in processes.started if p.name == name)


def _copy(app: Path, tmp_path: Path) -> Path:
    """A copy of a vendored app to run: `flwr run` rewrites an app's pyproject in place (it moves a
    `[tool.flwr.federations]` table into Flower's own configuration), which must not touch the vendored files."""
    copy = tmp_path / app.name
    shutil.copytree(app, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _project_name(app: Path) -> str:
    return tomllib.loads((app / "pyproject.toml").read_text())["project"]["name"]


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
    home.mkdir(parents=True)
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local-test"\n\n'
        f'[superlink.local-test]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    return home


def _wait_healthy(link: Started, port: int, logs: Callable[[], str]) -> None:
    """Until the SuperLink answers ``/health`` (an open port is not enough: start-up continues)."""
    def healthy() -> bool:
        if link.popen.poll() is not None:
            pytest.fail(f"the SuperLink exited with rc {link.popen.returncode}\n{logs()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    wait_for(healthy, START_TIMEOUT_S, lambda: f"the SuperLink to be healthy\n{logs()}", poll_s=0.2)


def _wait_for_log(started: Started, text: str, logs: Callable[[], str]) -> None:
    def logged() -> bool:
        if started.popen.poll() is not None:
            pytest.fail(f"{started.name} exited with rc {started.popen.returncode}\n{logs()}")
        return text in started.log.read_text(errors="replace")

    wait_for(logged, START_TIMEOUT_S, lambda: f"{started.name} to log {text!r}\n{logs()}", poll_s=0.2)


def _wait_finished(store: RunStore, run_id: str, timeout_s: float = 30.0) -> Run:
    """The run row once it leaves ``running`` (``flwr run --stream`` may return a moment early)."""
    def ended() -> Run | None:
        run = store.get_run(run_id)
        return run if run.status != "running" else None

    return wait_for(ended, timeout_s, f"run {run_id} to leave 'running'", poll_s=0.2)
