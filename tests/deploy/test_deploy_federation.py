"""End to end over TLS with authenticated clients, on loopback: the aggregator
host (SuperLink behind nginx), three client agents, and the failures a real
federation meets. The tests share one federation and run in file order; the
last one kills a client for good.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization

from deploy.flower import bin_path, flower_env
from deploy.loopback import free_ports
from tests.conftest import wait_for
from tests.deploy.conftest import DEVICES, Fed, needs_nginx

pytestmark = [needs_nginx, pytest.mark.e2e, pytest.mark.heavy]


def _post(fed: Fed, path: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    context = ssl.create_default_context(cafile=str(fed.lb.deploy.state.tls / "ca.pem"))
    conn = http.client.HTTPSConnection("127.0.0.1", fed.lb.port, context=context, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/protobuf", **(headers or {})})
        return conn.getresponse().status
    finally:
        conn.close()


def _register_request(key: Path) -> bytes:
    from flwr.proto.control_pb2 import RegisterNodeRequest  # pylint: disable=no-name-in-module

    public = serialization.load_ssh_private_key(key.read_bytes(), password=None).public_key()
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return RegisterNodeRequest(public_key=pem, name="rogue").SerializeToString()


def _node_count(fed: Fed) -> int:
    from deploy.flower import list_nodes

    return len(list_nodes(fed.lb.deploy))


def test_device_side_refuses_the_control_api(fed: Fed) -> None:
    # Prepare: the very request that registers a rogue key when sent to the SuperLink itself
    body = _register_request(fed.stranger_key)
    before = _node_count(fed)

    # Execute
    statuses = {path: _post(fed, path, body) for path in (
        "/v1/control/register-node", "/v1/control/list-nodes", "/v1/control/start-run",
        "/v1/runtime/pull-app-messages", "/v1/fleet/../control/register-node",
        "/v1/fleet/pull-messages/../../control/register-node", "/docs")}
    unsigned = _post(fed, "/v1/fleet/activate-node", b"")

    # Assert: nginx answers 403 without forwarding; the Fleet API itself demands a signature
    assert set(statuses.values()) == {403}, statuses
    assert unsigned in (400, 401, 415, 422), unsigned
    assert _node_count(fed) == before


def test_an_unregistered_key_cannot_join(fed: Fed) -> None:
    # Prepare: a SuperNode with a key nobody enrolled, no retries
    ca = fed.lb.deploy.state.tls / "ca.pem"
    argv = [bin_path("flower-supernode"), "--superlink", fed.lb.address, "--root-certificates", str(ca),
            "--auth-supernode-private-key", str(fed.stranger_key), "--max-retries", "0",
            "--isolation", "process", "--port", str(free_ports(1)[0])]

    # Execute
    stranger = fed.lb.procs.start("stranger", argv, env=flower_env(fed.lb.deploy))
    try:
        rc = stranger.popen.wait(timeout=60)
    except subprocess.TimeoutExpired:
        stranger.kill_group()
        pytest.fail(f"the unregistered SuperNode was not refused within 60 s\n{stranger.text()}")

    # Assert
    assert rc != 0
    assert "SuperNode ID:" not in stranger.text()
    assert "Failed to activate SuperNode" in stranger.text(), stranger.text()[-2000:]


def _reference_run(fed: Fed) -> dict[str, object]:
    """Three rounds, nothing interrupted: the run the resume test must reproduce."""
    if not fed.reference:
        flower_run = fed.submit(fed.scenario("reference"))
        run = fed.wait_finished(fed.stored_run(flower_run).id, timeout_s=180)
        fed.reference.update(run=run, params=fed.final_params(run.id))
    return fed.reference


def test_three_rounds_over_tls_with_authenticated_clients(fed: Fed) -> None:
    # Execute
    ref = _reference_run(fed)

    # Assert
    run = ref["run"]
    assert (run.status, run.rounds_done) == ("finished", 3), f"{run.status}: {run.error}\n{fed.logs()}"
    rounds = fed.store.rounds(run.id)
    assert [r.round for r in rounds] == [1, 2, 3]
    for r in rounds:
        outcomes = [c.outcome for c in fed.store.client_results(run.id, r.round)]
        assert outcomes == ["ok"] * 3, (r.round, outcomes)
    assert rounds[-1].server_accuracy > 0.5
    names = sorted((run.info or {}).get("devices", {}).values())
    assert names == list(DEVICES)
    status = json.loads(fed.lb.cli("aggregator", "status", "-c", str(fed.lb.config), "--json").stdout)
    assert status["running"] and status["connected"] == 3
    assert sorted(c["name"] for c in status["clients"] if c["status"] == "online") == list(DEVICES)
    assert status["run"]["id"] == run.id
    with urllib.request.urlopen(f"http://127.0.0.1:{fed.lb.dashboard_port}/api/runs", timeout=10) as reply:
        assert run.id in {r["id"] for r in json.load(reply)}  # the dashboard reads the same store
    print(f"deployment: 3 clients x 3 rounds, round times {[round(r.duration_s, 1) for r in rounds]} s, "
          f"accuracy {rounds[-1].server_accuracy:.3f}")


def test_secure_aggregation_runs_with_the_identities_enrol_issued(fed: Fed) -> None:
    # Prepare: the devices were started with the identity and directory `quorum client enroll` wrote
    scenario = fed.scenario("secagg", rounds=1, extra="[secagg]\nenabled = true\n")

    # Execute: the actively secure protocol (the default threat model), signed adverts checked
    run = fed.wait_finished(fed.stored_run(fed.submit(scenario)).id, timeout_s=180)

    # Assert: every device signed, was verified and contributed to the masked sum
    assert (run.status, run.rounds_done) == ("finished", 1), f"{run.status}: {run.error}\n{fed.logs()}"
    (row,) = fed.store.rounds(run.id)
    assert row.secagg is not None and row.secagg["threat_model"] == "malicious", row.secagg
    assert [s["stage"] for s in row.secagg["stages"]][3] == "consistency_check"
    assert [c.outcome for c in fed.store.client_results(run.id, 1)] == ["ok"] * 3
    assert row.server_accuracy > 0.3


def _serverapp_pids(fed: Fed) -> list[int]:
    """The SuperLink's SuperExec and ServerApp processes (detached into sessions of their own)."""
    found = []
    for pid in fed.lb.procs.alive():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"flower-superexec" in cmd or b"flwr-serverapp" in cmd:
            found.append(pid)
    return found


def test_aggregator_killed_mid_run_resumes_to_the_same_model(fed: Fed) -> None:
    # Prepare: the uninterrupted run, and the same scenario (same seed) submitted again
    ref = _reference_run(fed)
    flower_run = fed.submit(fed.scenario("reference"))
    run_id = fed.stored_run(flower_run).id
    assert fed.wait_rounds(run_id, 1, timeout_s=120).rounds_done >= 1

    # Execute: the aggregator host crashes (SIGKILL to its whole process group), then restarts
    fed.lb.aggregator.kill_group(signal.SIGKILL)
    orphans = _serverapp_pids(fed)  # detached: they notice their SuperLink's death only later
    crashed_at = fed.store.get_run(run_id).rounds_done
    restarted = fed.lb.start_aggregator()  # stops those orphans and their Flower run first, then resumes the run
    run = fed.wait_finished(run_id, timeout_s=240)

    # Assert: every round committed once, and the model is the uninterrupted run's
    assert (run.status, run.rounds_done) == ("finished", 3), f"{run.status}: {run.error}\n{fed.logs()}"
    assert [r.round for r in fed.store.rounds(run_id)] == [1, 2, 3]
    assert 1 <= crashed_at < 3
    assert not fed.lb.procs.wait_gone(orphans, 5), "the crashed aggregator's ServerApp is still running"
    # the crashed Flower run, still "running" in the SuperLink's link state, was stopped before the front door
    # opened: no device pulls a message of it again
    log = " ".join(restarted.log.read_text(errors="replace").split())  # the console wraps its lines
    assert f"stopped 1 Flower run(s) left in this SuperLink's state without a ServerApp: [{flower_run}]" in log, log
    assert log.index("without a ServerApp") < log.index("aggregator ready")
    events = [e.message for e in fed.store.events(run_id)]
    assert any(m.startswith(f"resumed after round {crashed_at}") for m in events), events
    # Replies are folded as they arrive: arrival order moves the float32 sums in the last bits only.
    np.testing.assert_allclose(fed.final_params(run_id), ref["params"], rtol=1e-5, atol=1e-6)


def _child_pid(fed: Fed, name: str) -> int:
    """The pid of one process the aggregator's supervisor runs (its pid file's ``children``)."""
    return int(json.loads(fed.lb.deploy.state.pidfile.read_text())["children"][name])


def _children_of(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_superlink_killed_mid_round_is_restarted_and_its_run_resumes_by_itself(fed: Fed) -> None:
    # Prepare: the uninterrupted run, then the same scenario (same seed) again, up to round 2's first message
    ref = _reference_run(fed)
    log = fed.lb.supernode_log(DEVICES[0])
    seen = log.read_text(errors="replace").count("Receiving: train message")
    run_id = fed.stored_run(fed.submit(fed.scenario("reference"))).id
    wait_for(lambda: log.read_text(errors="replace").count("Receiving: train message") > seen + 1, 180,
             lambda: f"round 2 to be sent\n{fed.logs()}", poll_s=0.05)

    # Execute: the SuperLink alone dies (SIGKILL); the aggregator's supervisor lives on
    superlink = _child_pid(fed, "superlink")
    os.kill(superlink, signal.SIGKILL)
    killed_at = time.monotonic()
    crashed_at = fed.store.get_run(run_id).rounds_done

    def resumed() -> bool:
        return any(e.message.startswith("resumed after round") for e in fed.store.events(run_id))

    wait_for(resumed, 90, lambda: f"the run to resume by itself\n{fed.logs()}", poll_s=0.1)
    resumed_s = time.monotonic() - killed_at
    run = fed.wait_finished(run_id, timeout_s=240)

    # Assert: a new SuperLink; no person needed; every round once; the uninterrupted run's model
    assert _child_pid(fed, "superlink") != superlink
    assert resumed_s <= 30.0, f"resumed {resumed_s:.1f} s after the kill"
    assert (run.status, run.rounds_done) == ("finished", 3), f"{run.status}: {run.error}\n{fed.logs()}"
    assert [r.round for r in fed.store.rounds(run_id)] == [1, 2, 3] and 1 <= crashed_at < 3
    events = [e.message for e in fed.store.events(run_id)]
    assert any(m.startswith(f"the SuperLink exited and was restarted after round {crashed_at}") for m in events)
    np.testing.assert_allclose(fed.final_params(run_id), ref["params"], rtol=1e-5, atol=1e-6)
    print(f"SuperLink killed after round {crashed_at}: resumed by itself {resumed_s:.1f} s after the kill")


def test_the_nginx_master_killed_alone_is_replaced_with_its_workers_within_10_s(fed: Fed) -> None:
    # Prepare: the front door's master and its workers (they would hold the port after the master's death)
    from deploy.supervisor import health_url, wait_healthy

    master = _child_pid(fed, "proxy")
    workers = _children_of(master)
    assert workers, "nginx runs no worker"
    proxy_log = fed.lb.deploy.state.logs / "proxy.log"
    before = proxy_log.read_text(errors="replace") if proxy_log.exists() else ""

    # Execute: SIGKILL the master alone
    os.kill(master, signal.SIGKILL)
    killed_at = time.monotonic()

    def replaced() -> bool:
        return _child_pid(fed, "proxy") != master and not any(_alive(w) for w in workers)

    wait_for(replaced, 30, lambda: f"a new nginx master\n{fed.logs()}", poll_s=0.05)
    wait_healthy(health_url("localhost", fed.lb.port, True), fed.lb.deploy.state.tls / "ca.pem", None, 30.0,
                 "the front door")
    back_s = time.monotonic() - killed_at

    # Assert: back within 10 s, the old workers gone, the new master up, no bind failure
    assert back_s <= 10.0, f"the front door was back {back_s:.1f} s after the kill"
    assert _alive(_child_pid(fed, "proxy"))
    after = proxy_log.read_text(errors="replace")[len(before):]
    assert "Address already in use" not in after, after[-2000:]
    print(f"nginx master killed: the front door back in {back_s:.1f} s")


def test_a_client_killed_mid_round_is_recorded_as_dropped(fed: Fed) -> None:
    # Prepare: a short deadline (each round waits it out for dev2; the live devices answer in 1-4 s on a
    # loaded 2-core machine), and dev2's log position before the run
    victim, deadline = "dev2", 6.0
    log = fed.lb.supernode_log(victim)
    seen = log.read_text(errors="replace").count("Receiving: train message")
    flower_run = fed.submit(fed.scenario("dropout", rounds=2, deadline=deadline))

    # Execute: kill dev2's agent (SIGKILL, its whole group) as soon as it receives a train message
    wait_for(lambda: log.read_text(errors="replace").count("Receiving: train message") > seen, 120,
             lambda: f"{victim} to receive the round\n{fed.logs()}", poll_s=0.02)
    fed.lb.agents[victim].kill_group(signal.SIGKILL)
    run = fed.wait_finished(fed.stored_run(flower_run).id, timeout_s=120)

    # Assert: both rounds complete with the other two; dev2 is recorded as dropped, within the deadline, and
    # the run says it did not learn from dev2 (degraded: exit 3 of `aggregator run --wait`)
    assert (run.status, run.rounds_done) == ("degraded", 2), f"{run.status}: {run.error}\n{fed.logs()}"
    assert run.error == "dev2 never contributed (dropped in 2 of 2 rounds)", run.error
    devices = {int(k): v for k, v in (run.info or {}).get("devices", {}).items()}
    for r in fed.store.rounds(run.id):
        by_name = {devices[int(c.client)]: c.outcome for c in fed.store.client_results(run.id, r.round)}
        assert by_name == {"dev0": "ok", "dev1": "ok", "dev2": "dropped"}, (r.round, by_name)
        assert r.dropped == 1 and r.answered == 2
        assert r.duration_s < deadline + 15.0, r.duration_s
