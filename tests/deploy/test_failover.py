"""Two aggregators on one PostgreSQL run store: the leader is SIGKILLed mid-run, the standby finishes it.

Everything is real: PostgreSQL (``tests/postgres_server.py``), two ``quorum
aggregator start`` processes (the second with ``--standby``, its own state
folder holding a copy of the first's TLS files, as on a second host), nginx
front doors on the same device-facing port, three TLS devices that were
enrolled once, with the first. The standby learns the devices from the run
store (``deploy/failover.py``); the devices are never told about it.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from deploy.config import load_config
from deploy.enroll import load_registry
from deploy.flower import node_infos
from deploy.loopback import LoopbackFederation, Processes, Started, write_device_data
from deploy.pki import make_node_key
from privacy.dp.accountant import plan_epsilon
from runstore.devices import stored_devices
from tests.conftest import wait_for
from tests.deploy.conftest import DEVICES, Fed, _wait_connected, needs_nginx
from tests.postgres_server import postgres_server

pytestmark = [pytest.mark.e2e, needs_nginx]  # PostgreSQL, two aggregators, three agents


@dataclass
class Pair:
    """The federation, and the config file of each aggregator host: ``configs[0]`` started as the leader."""

    fed: Fed
    configs: tuple[Path, Path]
    up: dict[Path, Started]

    def leader_config(self) -> Path:
        """The config of the aggregator that leads now: it wrote its pid file once up, and is alive."""
        for path in self.configs:
            pidfile = load_config(path).state.pidfile
            if pidfile.exists() and self.up[path].popen.poll() is None and \
                    json.loads(pidfile.read_text())["pid"] == self.up[path].popen.pid:
                return path
        raise AssertionError("no aggregator leads")

    def submit(self, scenario: Path) -> int:
        done = self.fed.lb.cli("aggregator", "run", str(scenario), "-c", str(self.leader_config()))
        assert done.returncode == 0, f"submit failed:\n{done.stdout}\n{done.stderr}\n{self.fed.logs()}"
        return int(done.stdout.split("Flower run")[1].split()[0])

    def train_messages(self) -> int:
        """How many train messages the first device has received so far."""
        return self.fed.lb.supernode_log(DEVICES[0]).read_text(errors="replace").count("Receiving: train message")

    def kill_leader_in_round(self, run_id: str, server_round: int, before: int, per_round: int = 1) -> float:
        """SIGKILL the leading aggregator's process group in ``server_round``; return when.

        In: once the first device received the round's first train message (of ``per_round`` a round,
        counted from ``before``, the count when the run was submitted), before the round commits.
        """
        fed = self.fed
        wait_for(lambda: self.train_messages() > before + per_round * (server_round - 1), 240,
                 lambda: f"round {server_round} to be sent\n{fed.logs()}", poll_s=0.05)
        leader = self.leader_config()
        self.up[leader].kill_group(signal.SIGKILL)
        killed_at = time.monotonic()
        assert fed.store.get_run(run_id).rounds_done == server_round - 1, "the round ended before the kill"
        return killed_at


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Iterator[Pair]:
    work = tmp_path_factory.mktemp("failover")
    procs = Processes(work)
    with postgres_server() as url:
        lb = LoopbackFederation(work, procs, poll_s=0.5, database=url)
        try:
            fed = Fed(lb, {}, make_node_key(work / "stranger.key", "stranger").private)
            paths = write_device_data(fed.scenario("data"), work / "data")
            fed.data = dict(zip(DEVICES, paths, strict=True))
            first = lb.start_aggregator()
            for name in DEVICES:
                lb.enroll(name)
            second_config = lb.second_host()
            second = lb.start_aggregator(config=second_config, standby=True)
            for name in DEVICES:
                lb.start_agent(name, fed.data[name], wait=False)
            _wait_connected(fed)
            yield Pair(fed, (lb.config, second_config), {lb.config: first, second_config: second})
        finally:
            procs.stop_all()
            if fed._store is not None:
                fed._store.close()
            left = procs.alive()
            assert not left, f"processes outlived the failover tests: {left}"


def test_a_standby_refuses_to_lead_while_the_leader_holds_the_lock(pair: Pair) -> None:
    # Execute: a third aggregator of the same federation, started without --standby
    done = pair.fed.lb.cli("aggregator", "start", "-c", str(pair.configs[1]), timeout_s=60)

    # Assert: refused with who leads and what to do, and the standby still waits (no SuperLink of its own)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "another aggregator leads federation 'loopback'" in done.stderr and "--standby" in done.stderr
    assert "waiting" in pair.up[pair.configs[1]].text()
    assert not load_config(pair.configs[1]).state.pidfile.exists()


def test_the_standby_finishes_a_run_whose_leader_was_killed_in_round_3(pair: Pair) -> None:
    # Prepare: the uninterrupted run, then the same scenario (same seed) again
    fed = pair.fed
    scenario = fed.scenario("failover", rounds=6)
    ref_run = fed.wait_finished(fed.stored_run(pair.submit(scenario)).id, timeout_s=240)
    assert ref_run.status == "finished", f"{ref_run.error}\n{fed.logs()}"
    reference = fed.final_params(ref_run.id)
    before = pair.train_messages()
    run_id = fed.stored_run(pair.submit(scenario)).id

    # Execute: the leading host dies (SIGKILL to its whole process group) in the middle of round 3
    killed_at = pair.kill_leader_in_round(run_id, 3, before)
    wait_for(lambda: pair.train_messages() > before + 3, 120, lambda: f"the standby's first message\n{fed.logs()}",
             poll_s=0.05)
    first_message_s = time.monotonic() - killed_at
    run = fed.wait_finished(run_id, timeout_s=300)

    # Assert: every round committed once; the model is the uninterrupted run's; the failover is an event
    assert (run.status, run.rounds_done) == ("finished", 6), f"{run.status}: {run.error}\n{fed.logs()}"
    assert [r.round for r in fed.store.rounds(run_id)] == [1, 2, 3, 4, 5, 6]
    got = fed.final_params(run_id)
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-6)
    events = [e.message for e in fed.store.events(run_id)]
    assert any(m.startswith("failover: ") and "took over after round 2" in m for m in events), events
    assert any(m.startswith("resumed after round 2") for m in events), events
    standby = load_config(pair.configs[1])
    with urllib.request.urlopen(f"http://127.0.0.1:{fed.lb.dashboard_port}/api/runs/{run_id}/log",
                                timeout=10) as reply:  # the standby's dashboard, on the same port
        shown = [e["message"] for e in json.load(reply)]
    assert any(m.startswith("failover: ") for m in shown), shown
    # the standby's SuperLink knows every device by the node id and key it was enrolled with on the leader
    enrolled = {d.node_id: d for d in load_registry(load_config(pair.configs[0])).values()}
    nodes = {int(n.node_id): n for n in node_infos(standby)}
    assert set(nodes) == set(enrolled) == {int(r.node_id) for r in stored_devices(fed.store)}
    assert {nodes[i].status for i in nodes} == {"online"}
    assert load_registry(standby) == load_registry(load_config(pair.configs[0]))
    print(f"failover: max |difference| to the uninterrupted run {np.max(np.abs(got - reference)):.2e}; "
          f"kill -> the standby's first train message {first_message_s:.1f} s")


def test_a_secure_aggregation_dp_run_fails_back_to_the_restarted_first_host(pair: Pair) -> None:
    # Prepare: the killed host comes back as the standby; a run with secure aggregation and distributed DP
    fed = pair.fed
    first = pair.configs[0]
    pair.up[first] = fed.lb.start_aggregator(config=first, standby=True)
    assert pair.leader_config() == pair.configs[1]
    z, delta = 1.0, 1e-3
    scenario = fed.scenario("failback", rounds=3, extra=(
        "[secagg]\nenabled = true\n\n[dp]\nenabled = true\nplacement = \"distributed\"\n"
        f"noise_multiplier = {z}\nclip_norm = 1.0\nsampling = \"poisson\"\ndelta = {delta}\n"))
    before = pair.train_messages()
    run_id = fed.stored_run(pair.submit(scenario)).id

    # Execute: the second host dies in round 2 (a train message per protocol stage); the first takes over
    first_round = fed.wait_rounds(run_id, 1, timeout_s=240)
    assert first_round.rounds_done == 1, f"{first_round.status}: {first_round.error}\n{fed.logs()}"
    stages = len(fed.store.rounds(run_id)[0].secagg["stages"])
    pair.kill_leader_in_round(run_id, 2, before, per_round=stages)
    run = fed.wait_finished(run_id, timeout_s=300)

    # Assert: the replayed round was run again from its first stage (a whole secure-aggregation record of
    # its own: the devices in its sum are those that answered it) and accounted once: each round's epsilon
    # is the accountant's for that many rounds. (A device whose SuperNode still held its reply to the dead
    # leader's run may miss the replayed round: Flower's SuperNode sends the fresh reply only after giving
    # up on the stale one, docs/deploy.md; secure aggregation then sums the others.)
    assert run.status in ("finished", "degraded") and run.rounds_done == 3, f"{run.status}: {run.error}\n{fed.logs()}"
    assert pair.leader_config() == first
    rows = fed.store.rounds(run_id)
    assert [r.round for r in rows] == [1, 2, 3]
    assert [c.outcome for c in fed.store.client_results(run_id, 1)] == ["ok"] * 3
    for r in rows:
        assert r.secagg is not None and [s["stage"] for s in r.secagg["stages"]][0] == "advertise_keys", r.secagg
        outcomes = [c.outcome for c in fed.store.client_results(run_id, r.round)]
        assert r.secagg["survivors"] == r.answered == outcomes.count("ok") >= 2, (r.round, r.secagg, outcomes)
        assert r.epsilon == pytest.approx(plan_epsilon(1.0, r.round, z, delta, "poisson"), rel=1e-9)
    events = [e.message for e in fed.store.events(run_id)]
    assert any("took over after round 1" in m for m in events), events
