"""Edge aggregators deployed on loopback: the aggregator, two edges with their own SuperLink and front door,
three TLS devices under each, secure aggregation inside the edges, and one edge killed mid-round 2 of 4.

Everything is started by the real commands: ``aggregator start`` for the aggregator,
``aggregator start --edge --upstream`` for each edge (its key enrolled at the
aggregator with ``client enroll``), ``client start`` for each device (enrolled
at its edge). The killed edge is a host that dies: every process of it at once
(SIGKILL), its devices left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.loopback import LoopbackFederation, Processes, write_device_data
from deploy.readiness import fleet
from runstore.store import Run, RunStore
from tests.conftest import wait_for
from tests.deploy.conftest import needs_nginx

pytestmark = [pytest.mark.e2e, needs_nginx]

EDGES = {"edge-a": ("a0", "a1", "a2"), "edge-b": ("b0", "b1", "b2")}
SCENARIO = """
name = "edge-tree"
seed = 5
rounds = 4
[data]
dataset = "digits"
partition = "iid"
[model]
name = "logreg"
[federation]
clients = 6
fraction = 1.0
min_clients = 3
deadline_s = 20.0
weighting = "capped"
[training]
local_epochs = 1
batch_size = 32
lr = 0.1
[evaluation]
federated = true
server = true
every = 4
[secagg]
enabled = true
[hierarchy]
edges = 2
"""


@dataclass
class Tree:
    top: LoopbackFederation
    edges: dict[str, LoopbackFederation]
    hosts: dict[str, Processes]  # each edge host's own processes (its devices are not among them)
    scenario: Path

    def logs(self, lines: int = 30) -> str:
        out = []
        for path in sorted(self.top.workdir.parent.rglob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"===== {path} =====\n" + "\n".join(text))
        return "\n".join(out)


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tree]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # ~25 processes share 2 cores
    for folder in ("top", *EDGES):
        (tmp_path / folder).mkdir()
    devices = Processes(tmp_path)
    hosts = {name: Processes(tmp_path / name) for name in EDGES}  # logs apart: each host has its aggregator-0.log
    try:
        top = LoopbackFederation(tmp_path / "top", devices, poll_s=0.5)
        scenario = tmp_path / "edge-tree.toml"
        scenario.write_text(SCENARIO)
        data = write_device_data(scenario, tmp_path / "data")
        top.start_aggregator()
        edges: dict[str, LoopbackFederation] = {}
        for i, (name, members) in enumerate(EDGES.items()):
            top.enroll(name)  # the edge is one device of the aggregator's
            edge = LoopbackFederation(tmp_path / name, hosts[name], poll_s=0.5, name=name, dashboard=False)
            edge.start_aggregator(extra=["--edge", "--upstream", top.address, "--upstream-key", str(top.key(name)),
                                         "--upstream-ca", str(top.deploy.state.tls / "ca.pem")])
            edge.procs = devices  # its devices are not the edge host's processes: killing the host spares them
            for j, device in enumerate(members):
                edge.enroll(device)
                edge.start_agent(device, data[3 * i + j], wait=False)
            edges[name] = edge
        built = Tree(top, edges, hosts, scenario)
        wait_for(lambda: len(fleet(top.deploy).online) == 2, 120, lambda: f"both edges online\n{built.logs()}",
                 poll_s=0.5)
        for edge in edges.values():
            for device in EDGES[edge.name]:
                wait_for(lambda e=edge, d=device: "SuperNode ID:" in _text(e.supernode_log(d)), 120,
                         lambda d=device: f"{d} to connect\n{built.logs()}", poll_s=0.2)
        yield built
    finally:
        for procs in (*hosts.values(), devices):
            procs.stop_all()
        left = [p for procs in (*hosts.values(), devices) for p in procs.alive()]
        assert not left, f"processes outlived the test: {left}"


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _received(tree: Tree, edge: str) -> int:
    return sum(_text(tree.edges[edge].supernode_log(d)).count("Receiving:") for d in EDGES[edge])


def test_a_tree_deployed_on_loopback_survives_an_edge_killed_mid_round(tree: Tree) -> None:
    # Execute: submit the run at the aggregator, as for a flat federation
    done = tree.top.cli("aggregator", "run", str(tree.scenario), "-c", str(tree.top.config), timeout_s=180)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{tree.logs()}"
    flower_run = int(done.stdout.split("Flower run")[1].split()[0])
    store = RunStore(tree.top.deploy.db_url)

    def opened() -> Run | None:
        runs = [r for r in store.list_runs() if (r.info or {}).get("flower_run_id") == flower_run]
        return runs[0] if runs else None

    run = wait_for(opened, 180, lambda: f"the run to open\n{tree.logs()}", poll_s=0.5)
    wait_for(lambda: store.get_run(run.id).rounds_done >= 1 or store.get_run(run.id).status != "running", 240,
             lambda: f"round 1\n{tree.logs()}", poll_s=0.2)
    assert store.get_run(run.id).rounds_done == 1, f"{store.get_run(run.id).error}\n{tree.logs()}"
    # edge-b's host dies once round 2 reached its devices: every process of it, at once
    seen = _received(tree, "edge-b")
    wait_for(lambda: _received(tree, "edge-b") > seen, 120, lambda: f"round 2 at edge-b\n{tree.logs()}", poll_s=0.05)
    for pid in tree.hosts["edge-b"].alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run = wait_for(lambda: (r := store.get_run(run.id)).status not in ("running", "interrupted") and r, 400,
                   lambda: f"the run to end\n{tree.logs()}", poll_s=0.5)

    # Assert: all four rounds committed; in round 2 edge-b's three devices are dropped and edge-a's trained
    assert run.rounds_done == 4 and run.status in ("finished", "degraded"), f"{run.status}: {run.error}\n{tree.logs()}"
    names = {int(k): v for k, v in (run.info or {}).get("devices", {}).items()}
    assert sorted(names.values()) == sorted(f"{e}/{d}" for e, ds in EDGES.items() for d in ds)
    rounds = store.rounds(run.id)
    first = {names[int(c.client)]: c.outcome for c in store.client_results(run.id, 1)}
    assert first == {name: "ok" for name in names.values()}, first  # secure aggregation inside both edges
    second = {names[int(c.client)]: (c.outcome, c.reason) for c in store.client_results(run.id, 2)}
    assert {n: o for n, (o, _) in second.items()} == {
        **{f"edge-a/{d}": "ok" for d in EDGES["edge-a"]}, **{f"edge-b/{d}": "dropped" for d in EDGES["edge-b"]}}
    assert all("edge edge-b dropped" in (why or "") for n, (o, why) in second.items() if o == "dropped")
    by_edge = {e["name"]: e for e in rounds[1].tree["edges"]}
    assert (by_edge["edge-a"]["answered"], by_edge["edge-b"]["dropped"]) == (3, 3), rounds[1].tree
    for r in rounds[2:]:  # edge-a's devices go on learning
        ok = {names[int(c.client)] for c in store.client_results(run.id, r.round) if c.outcome == "ok"}
        assert {f"edge-a/{d}" for d in EDGES["edge-a"]} <= ok, (r.round, ok)
    assert rounds[-1].server_accuracy > 0.5
    print(f"edge deployment: round times {[round(r.duration_s, 1) for r in rounds]} s, "
          f"accuracy {rounds[-1].server_accuracy:.3f}")
