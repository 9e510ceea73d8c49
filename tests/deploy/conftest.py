"""A TLS federation on loopback shared by the deployment tests: an aggregator,
three enrolled client agents, and a key nobody enrolled.

Everything is started by the real commands (``python -m deploy
aggregator start`` / ``client start``) and stopped by PID at the end; a test
that leaves a process behind fails.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from deploy.loopback import LoopbackFederation, Processes, write_device_data
from deploy.pki import make_node_key
from runstore.store import Run, RunStore
from tests.conftest import wait_for

DEVICES = ("dev0", "dev1", "dev2")

SCENARIO = """
name = "deploy-{name}"
seed = 11
rounds = {rounds}
[data]
dataset = "digits"
partition = "iid"
[model]
name = "logreg"
[federation]
clients = 3
fraction = 1.0
min_clients = 2
deadline_s = {deadline}
[training]
local_epochs = 1
batch_size = 32
lr = 0.1
[evaluation]
federated = true
server = true
every = {rounds}                 # federated evaluation in the last round only
"""

needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                                 reason="nginx is not installed (apt-get install nginx-light)")


@dataclass
class Fed:
    """The shared federation and what tests learn about it."""

    lb: LoopbackFederation
    data: dict[str, Path]
    stranger_key: Path
    reference: dict[str, object] = field(default_factory=dict)
    _store: RunStore | None = field(default=None, repr=False)

    @property
    def store(self) -> RunStore:
        """The federation's run store, opened once (polls would each hold a PostgreSQL connection)."""
        if self._store is None:
            self._store = RunStore(self.lb.deploy.db_url)
        return self._store

    def scenario(self, name: str, rounds: int = 3, deadline: float = 40.0, extra: str = "") -> Path:
        path = self.lb.workdir / f"{name}.toml"
        path.write_text(SCENARIO.format(name=name, rounds=rounds, deadline=deadline) + extra)
        return path

    def submit(self, scenario: Path) -> int:
        done = self.lb.cli("aggregator", "run", str(scenario), "-c", str(self.lb.config))
        assert done.returncode == 0, f"submit failed:\n{done.stdout}\n{done.stderr}\n{self.logs()}"
        return int(done.stdout.split("Flower run")[1].split()[0])

    def stored_run(self, flower_run: int, timeout_s: float = 60.0) -> Run:
        def opened() -> Run | None:
            runs = [r for r in self.store.list_runs() if (r.info or {}).get("flower_run_id") == flower_run]
            return runs[0] if runs else None

        return wait_for(opened, timeout_s, lambda: f"Flower run {flower_run} to open a stored run\n{self.logs()}",
                        poll_s=0.2)

    def wait_rounds(self, run_id: str, rounds: int, timeout_s: float) -> Run:
        def reached() -> Run | None:
            run = self.store.get_run(run_id)
            return run if run.rounds_done >= rounds or run.status not in ("running", "interrupted") else None

        return wait_for(reached, timeout_s, lambda: f"run {run_id} to reach round {rounds}\n{self.logs()}",
                        poll_s=0.2)

    def wait_finished(self, run_id: str, timeout_s: float) -> Run:
        def ended() -> Run | None:
            run = self.store.get_run(run_id)
            return run if run.status not in ("running", "interrupted") else None

        return wait_for(ended, timeout_s, lambda: f"run {run_id} to end\n{self.logs()}", poll_s=0.2)

    def final_params(self, run_id: str) -> np.ndarray:
        state = self.store.load_state(run_id)
        assert state is not None
        return state.params

    def logs(self, lines: int = 40) -> str:
        out = []
        for path in sorted(self.lb.workdir.rglob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"===== {path.relative_to(self.lb.workdir)} =====\n" + "\n".join(text))
        return "\n".join(out)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread in every process the federation starts (inherited through the environment).

    Three agents' workers and the ServerApp share the machine (2 cores, and other tests): with torch's
    default of a thread per core, every small step of one waits for threads the others hold, and a
    round's training took 10 to 40 times as long as on one thread.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Iterator[Fed]:
    work = tmp_path_factory.mktemp("federation")
    procs = Processes(work)
    lb = LoopbackFederation(work, procs, poll_s=0.5)  # idle SuperNodes poll twice a second: CPU for the other tests
    try:
        fed = Fed(lb, {}, make_node_key(work / "stranger.key", "stranger").private)
        paths = write_device_data(fed.scenario("data"), work / "data")
        fed.data = dict(zip(DEVICES, paths, strict=True))
        lb.start_aggregator()
        for name in DEVICES:
            lb.enroll(name)
        for name in DEVICES:  # start all three, then wait: they connect in parallel
            lb.start_agent(name, fed.data[name], wait=False)
        _wait_connected(fed)
        yield fed
    finally:
        procs.stop_all()
        left = procs.alive()
        assert not left, f"processes outlived the deployment tests: {left}"


def _wait_connected(fed: Fed, timeout_s: float = 90.0) -> None:
    def connected() -> bool:
        logs = [fed.lb.supernode_log(n) for n in DEVICES]
        return all(p.exists() and "SuperNode ID:" in p.read_text(errors="replace") for p in logs)

    wait_for(connected, timeout_s, lambda: f"the agents to connect\n{fed.logs()}", poll_s=0.2)
