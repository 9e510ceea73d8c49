"""A device's site policy over a real deployment (issue 48, "Done when"): a device whose policy requires secure
aggregation refuses a plain round and accepts a secure one; the CLI and ``--json`` name the refusal, and the run
does not end ``finished`` as if nothing happened.

A federation of its own on loopback (a real SuperLink behind TLS, three enrolled agents started by the real
``client start``; ``dev0`` with ``--policy``), stopped by PID at the end.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from deploy.loopback import LoopbackFederation, Processes, write_device_data
from deploy.pki import make_node_key
from tests.deploy.conftest import DEVICES, Fed, _wait_connected

pytestmark = [pytest.mark.e2e, pytest.mark.heavy]

REFUSED_LINE = "2/3 answered, 1 refused (policy: secure aggregation required [dev0])"
REFUSED_RUN = "1 of 3 sites refused: secure aggregation required (dev0)"


@pytest.fixture(scope="module")
def policed(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Iterator[Fed]:
    work = tmp_path_factory.mktemp("policed")
    procs = Processes(work)
    lb = LoopbackFederation(work, procs, poll_s=0.5)
    try:
        fed = Fed(lb, {}, make_node_key(work / "stranger.key", "stranger").private)
        fed.data = dict(zip(DEVICES, write_device_data(fed.scenario("data"), work / "data"), strict=True))
        policy = work / "dev0-policy.toml"  # the data owner's, on the device: the aggregator never sees it
        policy.write_text("require_secure_aggregation = true\n")
        lb.start_aggregator()
        for name in DEVICES:
            lb.enroll(name)
        for name in DEVICES:
            lb.start_agent(name, fed.data[name], wait=False, policy=policy if name == "dev0" else None)
        _wait_connected(fed)
        yield fed
    finally:
        procs.stop_all()
        left = procs.alive()
        assert not left, f"processes outlived the site-policy tests: {left}"


def _run_and_wait(fed: Fed, name: str, extra: str = "") -> tuple[int, str]:
    """Submit a one-round run with ``quorum aggregator run --wait``; its exit code and output."""
    scenario = fed.scenario(name, rounds=1, extra=extra)
    done = fed.lb.cli("aggregator", "run", str(scenario), "-c", str(fed.lb.config), "--wait", "--timeout", "240",
                      timeout_s=300)
    return done.returncode, done.stdout + done.stderr


def test_a_device_requiring_secure_aggregation_refuses_a_plain_round(policed: Fed) -> None:
    # Execute
    code, out = _run_and_wait(policed, "plain")

    # Assert: the round line and the run's end name the refusal; degraded (exit 3), not finished
    assert code == 3, f"{out}\n{policed.logs()}"
    assert f"round 1: {REFUSED_LINE}" in out
    assert f"degraded: {REFUSED_RUN}" in out
    status = json.loads(policed.lb.cli("aggregator", "status", "-c", str(policed.lb.config), "--json").stdout)
    assert (status["run"]["status"], status["run"]["error"]) == ("degraded", REFUSED_RUN)
    run = policed.store.get_run(status["run"]["id"])
    names = {str(k): v for k, v in (run.info or {}).get("devices", {}).items()}
    by_name = {names[c.client]: c for c in policed.store.client_results(run.id, 1)}
    assert (by_name["dev0"].outcome, by_name["dev0"].reason) == ("refused", "secure aggregation required")
    assert [by_name[n].outcome for n in ("dev1", "dev2")] == ["ok", "ok"]
    # the device's own console said so too
    worker_log = (policed.lb.workdir / "dev0" / "logs" / "worker.log").read_text(errors="replace")
    assert "(refused: secure aggregation required)" in worker_log


def test_the_same_device_accepts_a_secure_round(policed: Fed) -> None:
    # Execute
    code, out = _run_and_wait(policed, "secure", extra="[secagg]\nenabled = true\n")

    # Assert
    assert code == 0, f"{out}\n{policed.logs()}"
    assert "round 1: 3/3 answered" in out and "refused" not in out
    status = json.loads(policed.lb.cli("aggregator", "status", "-c", str(policed.lb.config), "--json").stdout)
    assert (status["run"]["status"], status["run"]["error"]) == ("finished", None)
