"""The deployment pieces that need no running federation: certificates, keys, config,
the nginx allow-list, the agent's command line, the run lease."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from aggregator.errors import TooFewClients
from aggregator.serverapp import wait_for_nodes
from core.records import RoundRecord
from core.strategy import ServerState
from deploy.agent import (
    IDLE_SLEEP_S,
    RECONNECT_MAX_S,
    REPLY_SLEEP_S,
    TASK_INPUT_S,
    AgentSpec,
    _PollClock,
    child_args,
    main,
    run_supernode,
    supernode_argv,
)
from deploy.config import ConfigError, load_config
from deploy.pki import ensure_tls, fingerprint, load_public_key, make_node_key, public_key_fingerprint
from deploy.proxy import FLEET_RPCS, ProxySpec, render_nginx_conf
from deploy.supervisor import resumable_runs
from runstore.store import RunStore
from runstore.takeover import LeaseLost, TakenRunStore
from tests.conftest import wait_for


def test_server_certificate_names_every_address_and_chains_to_the_ca(tmp_path: Path) -> None:
    # Execute
    files = ensure_tls(tmp_path, ["fl.example.org", "10.0.0.5", "localhost", "127.0.0.1"])

    # Assert
    chain = x509.load_pem_x509_certificates(files.server_cert.read_bytes())
    server, ca = chain[0], x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(sans.get_values_for_type(x509.DNSName)) == {"fl.example.org", "localhost"}
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"10.0.0.5", "127.0.0.1"}
    server.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert chain[1] == ca
    assert files.ca_key.stat().st_mode & 0o777 == 0o600 and files.server_key.stat().st_mode & 0o777 == 0o600
    assert len(fingerprint(files.ca_cert.read_bytes()).split(":")) == 32


def test_the_ca_is_kept_and_the_server_certificate_reissued_for_a_new_address(tmp_path: Path) -> None:
    first = ensure_tls(tmp_path, ["127.0.0.1"])
    ca_before, server_before = first.ca_cert.read_bytes(), first.server_cert.read_bytes()

    again = ensure_tls(tmp_path, ["127.0.0.1"])
    assert again.server_cert.read_bytes() == server_before
    moved = ensure_tls(tmp_path, ["127.0.0.1", "fl.example.org"])

    assert moved.ca_cert.read_bytes() == ca_before
    assert moved.server_cert.read_bytes() != server_before


def test_device_keys_are_p384_openssh_as_flower_reads_them(tmp_path: Path) -> None:
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    key = make_node_key(tmp_path / "dev.key", "dev")

    private = serialization.load_ssh_private_key(key.private.read_bytes(), password=None)
    assert isinstance(private, ec.EllipticCurvePrivateKey) and private.curve.name == "secp384r1"
    assert key.private.stat().st_mode & 0o777 == 0o600
    assert key.public_openssh.startswith("ecdsa-sha2-nistp384 ")
    assert public_key_to_bytes(load_public_key(key.public_openssh)).startswith(b"-----BEGIN PUBLIC KEY")
    assert public_key_fingerprint(key.public_openssh).startswith("SHA256:")


def test_other_key_types_are_refused() -> None:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    text = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    with pytest.raises(ValueError, match="P-384"):
        load_public_key(text)


@pytest.mark.parametrize(("text", "message"), [
    ("[aggregator]\nprot = 1\n", "aggregator.prot: unknown key"),
    ("[aggregator]\nport = 70000\n", "aggregator.port = 70000"),
    ("[aggregator]\nport = 9440\ninternal_port = 9440\n", "must differ"),
    ("[aggregator]\ninsecure = true\nlisten = \"0.0.0.0\"\n", "only allowed on loopback"),
    ("[dashboard]\nhost = \"0.0.0.0\"\n", "needs a token"),
    ("[superlink]\n", "unknown section [superlink]"),
    ("[aggregator]\nport = \"x\"\n", "aggregator.port = 'x'"),
    ("[aggregator]\nrate_limit = -1\n", "aggregator.rate_limit = -1: requests per second"),
])
def test_bad_federation_files_name_the_key_and_value(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "federation.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value)


def test_state_lives_beside_the_federation_file(tmp_path: Path) -> None:
    path = tmp_path / "federation.toml"
    path.write_text('[aggregator]\naddress = "fl.example.org"\nport = 9443\nstate_dir = "st"\n')

    cfg = load_config(path)

    assert cfg.state.root == tmp_path / "st"
    assert cfg.device_address == "fl.example.org:9443"
    assert cfg.db_url == f"sqlite:///{tmp_path / 'st' / 'runs' / 'quorum.db'}"
    assert {"fl.example.org", "127.0.0.1", "localhost"} <= set(cfg.cert_hosts)


def _spec(tmp_path: Path, tls: bool = True, port: int = 9443, rate_limit: int = 0, upstream: int = 9440
          ) -> ProxySpec:
    files = ensure_tls(tmp_path / "tls", ["127.0.0.1", "localhost"]) if tls else None
    return ProxySpec("127.0.0.1", port, upstream, files.server_cert if files else None,
                     files.server_key if files else None, files.ca_cert if files else None, tmp_path / "proxy",
                     rate_limit=rate_limit)


needs_nginx = pytest.mark.skipif(shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists(),
                                 reason="nginx is not installed")


def test_the_front_door_forwards_fleet_rpcs_and_health_only(tmp_path: Path) -> None:
    conf = render_nginx_conf(_spec(tmp_path))

    locations = [line.strip() for line in conf.splitlines() if line.strip().startswith("location")]
    assert locations == [f"location ~ ^/v1/fleet/({'|'.join(FLEET_RPCS)})$ {{", "location = /health {",
                         "location / {"]
    assert "return 403;" in conf.split("location / {")[1]
    assert "control" not in conf.replace("Control API", "") and "runtime" not in conf.replace("Runtime API", "")
    assert "proxy_ssl_verify on;" in conf and "127.0.0.1:9440" in conf


@needs_nginx
@pytest.mark.parametrize("tls", [True, False])
@pytest.mark.e2e
def test_nginx_accepts_the_rendered_configuration(tmp_path: Path, tls: bool) -> None:
    from deploy.proxy import nginx_command

    cmd = nginx_command(_spec(tmp_path, tls))
    done = subprocess.run([*cmd, "-t"], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr


def test_the_default_rate_limit_reaches_the_front_door(tmp_path: Path) -> None:
    path = tmp_path / "federation.toml"
    path.write_text("[aggregator]\n")
    limited = render_nginx_conf(_spec(tmp_path, rate_limit=load_config(path).aggregator.rate_limit))

    assert "zone=quorum_fleet:10m rate=200r/s;" in limited
    fleet, health = limited.split("location ~ ^/v1/fleet/")[1].split("location = /health")
    assert "limit_req zone=quorum_fleet burst=400 nodelay;" in fleet and "limit_req" not in health
    assert "limit_req" not in render_nginx_conf(_spec(tmp_path, rate_limit=0))


@needs_nginx
@pytest.mark.e2e
def test_the_front_door_answers_503_past_the_rate_limit(tmp_path: Path) -> None:
    import httpx

    from deploy.loopback import free_ports
    from deploy.proxy import nginx_command

    # Prepare: plain-HTTP nginx at 1 request/s (burst 2), with a SuperLink port nothing listens on
    port, upstream = free_ports(2)
    cmd = nginx_command(_spec(tmp_path, tls=False, port=port, rate_limit=1, upstream=upstream))
    nginx = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def answering() -> bool:
            assert nginx.poll() is None, "nginx exited before it answered"
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(f"{url}/health", timeout=2) is not None
            return False

        wait_for(answering, 20, "nginx to answer /health", poll_s=0.1)
        # Execute: ten Fleet requests at once from one address
        codes = [httpx.post(f"{url}/v1/fleet/pull-messages", content=b"", timeout=5).status_code
                 for _ in range(10)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(nginx.pid, signal.SIGTERM)
        nginx.wait(timeout=15)
    # Assert: the first and its burst of 2 reach the (absent) SuperLink, 502; the rest are
    # refused by the limit with 503 (a status Flower's SuperNode retries), nothing else
    # (a slow machine may earn a new token mid-way, hence "at least")
    assert codes[:4] == [502, 502, 502, 503] and codes.count(503) >= 5 and set(codes) == {502, 503}, codes


def test_the_agent_runs_an_authenticated_supernode_in_process_isolation(tmp_path: Path) -> None:
    spec = AgentSpec(server="fl.example.org:9443", data=tmp_path / "d.csv", key=tmp_path / "k", ca=tmp_path / "ca",
                     name="dev-a", runtime_port=9111)

    argv = supernode_argv(spec)

    assert argv[argv.index("--isolation") + 1] == "process"
    assert argv[argv.index("--auth-supernode-private-key") + 1] == str((tmp_path / "k").resolve())
    assert argv[argv.index("--root-certificates") + 1] == str((tmp_path / "ca").resolve())
    assert f'data-path="{(tmp_path / "d.csv").resolve()}"' in argv[argv.index("--node-config") + 1]
    assert "--insecure" not in argv and "--max-retries" not in argv  # retries forever
    with pytest.raises(ValueError, match="--ca"):
        supernode_argv(AgentSpec(server="h:1", data=tmp_path / "d", key=None, ca=None))


def test_the_agent_hands_its_secagg_identity_and_directory_to_the_node(tmp_path: Path) -> None:
    spec = AgentSpec(server="h:1", data=tmp_path / "d.csv", key=None, ca=None, insecure=True,
                     secagg_identity=tmp_path / "id.hex", secagg_directory=tmp_path / "dir.json")

    node_config = supernode_argv(spec)[supernode_argv(spec).index("--node-config") + 1]

    assert f'secagg-identity-key-file="{(tmp_path / "id.hex").resolve()}"' in node_config
    assert f'secagg-directory="{(tmp_path / "dir.json").resolve()}"' in node_config


def test_the_worker_gets_the_task_input_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[tuple] = []
    monkeypatch.setattr("deploy.agent.serve_tasks", lambda *args: served.append(args))
    monkeypatch.setattr("signal.signal", lambda *_: None)  # main's SIGTERM handler: not in pytest's process
    spec = AgentSpec(server="h:1", data=tmp_path / "d", key=None, ca=None, insecure=True, poll_s=2.0,
                     task_input_s=75.0)

    worker = child_args(spec)["worker"]
    main(["worker", *worker])
    main(["worker", "--runtime", "127.0.0.1:9094"])

    assert worker[worker.index("--poll-s") + 1] == "0.2"
    assert [(args[0], args[1], args[3]) for args in served] == [("127.0.0.1:9094", 0.2, 75.0),
                                                                ("127.0.0.1:9094", 0.2, TASK_INPUT_S)]


def test_a_non_positive_task_input_timeout_is_refused_by_name(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deploy.agent_cli import app

    data = tmp_path / "d.csv"
    data.write_text("x,label\n1,0\n")

    result = CliRunner().invoke(app, ["start", "--server", "h:1", "--data", str(data), "--insecure",
                                      "--task-input-timeout", "0"])

    assert result.exit_code != 0
    assert "--task-input-timeout 0.0: must be a positive number of seconds" in result.output


def test_the_supernodes_reconnection_back_off_is_capped_in_flowers_own_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    import flwr.supercore.retry.grpc_retry as grpc_retry
    import flwr.supercore.retry.http_retry as http_retry
    import flwr.supernode.start_client_internal as loop

    for module in (grpc_retry, http_retry):  # restored after the test: run_supernode sets them for its process
        monkeypatch.setattr(module, "MAX_RETRY_DELAY", module.MAX_RETRY_DELAY)
    monkeypatch.setattr(loop, "time", loop.time)
    monkeypatch.setattr(loop, "_push_messages", loop._push_messages)
    entry = importlib.import_module("flwr.supernode.cli.flower_supernode")  # the package re-exports the function
    monkeypatch.setattr(entry, "flower_supernode", lambda: None)
    monkeypatch.setattr("sys.argv", list(sys.argv))
    flower_bounds = [next(g) for g in [http_retry.make_simple_http_retry_invoker().wait_gen_factory()]
                     for _ in range(7)]

    run_supernode(["--insecure"], poll_s=1.0, reconnect_max_s=2.5)

    # Flower's own invokers, built after the cap as the SuperNode builds them per connection
    for invoker in (http_retry.make_simple_http_retry_invoker(), grpc_retry.make_simple_grpc_retry_invoker()):
        gen = invoker.wait_gen_factory()
        assert [next(gen) for _ in range(7)] == [1, 2, 2.5, 2.5, 2.5, 2.5, 2.5]
    assert flower_bounds == [1, 2, 4, 8, 16, 20, 20]  # what a device waited before: up to 20 s a try
    # and the waits themselves: full jitter below the bound, one failing request retried 30 times
    waits: list[float] = []
    invoker = http_retry.make_simple_http_retry_invoker()
    invoker.wait_function = waits.append
    invoker.max_tries = 31
    failures = iter(range(30))

    def request() -> str:
        if next(failures, None) is not None:
            raise httpx.ConnectError("refused")
        return "ok"

    assert invoker.invoke(request) == "ok"
    assert len(waits) == 30 and max(waits) <= 2.5 and min(waits) >= 0


def test_the_agent_passes_its_reconnection_cap_to_the_supernode(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple] = []
    monkeypatch.setattr("deploy.agent.run_supernode", lambda *args: ran.append(args))
    spec = AgentSpec(server="h:1", data=tmp_path / "d", key=None, ca=None, insecure=True, reconnect_max_s=3.0)

    main(["supernode", *child_args(spec)["supernode"]])
    main(["supernode", "--", "--insecure"])

    assert [args[1:] for args in ran] == [(1.0, 3.0), (1.0, RECONNECT_MAX_S)]
    assert ran[0][0][-2:] == supernode_argv(spec)[-2:]


@pytest.mark.parametrize("value", ["0", "0.1", "nan", "inf", "-4", "1e308"])
def test_a_reconnection_cap_out_of_range_is_refused_by_name(tmp_path: Path, value: str) -> None:
    from typer.testing import CliRunner

    from deploy.agent_cli import app

    data = tmp_path / "d.csv"
    data.write_text("x,label\n1,0\n")

    result = CliRunner().invoke(app, ["start", "--server", "h:1", "--data", str(data), "--insecure",
                                      "--reconnect-max", value])

    assert result.exit_code != 0
    assert "--reconnect-max" in result.output and "between 0.5 and 600 seconds" in result.output


def _node_state() -> tuple:
    """A SuperNode's own state and object store, as Flower 1.42 builds them."""
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.nodestate import NodeStateFactory

    objects = ObjectStoreFactory()
    return NodeStateFactory(objects).state(), objects.store()


def _instruction(run_id: int, round_: int) -> object:
    """A train message as the SuperLink sends it (its id set from its content, as on the wire)."""
    from flwr.app import ConfigRecord, Message, Metadata, RecordDict
    from flwr.app.message.message import make_message

    msg = make_message(Metadata(run_id=run_id, message_id="", src_node_id=1, dst_node_id=7,
                                reply_to_message_id="", group_id=str(round_), created_at=1.0, ttl=3600.0,
                                message_type="train"), RecordDict({"config": ConfigRecord({"round": round_})}))
    msg.metadata.__dict__["_message_id"] = msg.object_id
    assert isinstance(msg, Message)
    return msg


def _reply(to: object) -> object:
    from flwr.app import ConfigRecord, Message, RecordDict

    reply = Message(RecordDict({"metrics": ConfigRecord({"answers": to.metadata.message_id})}),  # type: ignore[attr-defined]
                    reply_to=to)  # type: ignore[arg-type]
    reply.metadata.__dict__["_message_id"] = reply.object_id
    return reply


@pytest.mark.parametrize("wrapped", [False, True], ids=["flowers-push", "fresh-replies-first"])
def test_a_reply_to_a_message_never_received_whole_does_not_stand_in_for_the_next(
        monkeypatch: pytest.MonkeyPatch, wrapped: bool) -> None:
    import flwr.supernode.start_client_internal as loop

    from deploy import agent

    # Prepare: the leader died after this device downloaded round 6 of the old run, before it confirmed it:
    # Flower deleted the message, the worker still replied. The standby's round 7 is then pulled; its reply
    # comes while the SuperNode waits to push.
    state, store = _node_state()
    old, new = _instruction(111, 6), _instruction(222, 7)
    assert len({old.metadata.message_id, new.metadata.message_id}) == 2  # type: ignore[attr-defined]
    loop._insert_message(old, state, store)
    stale = _reply(old)
    loop._insert_message(stale, state, store)
    state.delete_messages(message_ids=[old.metadata.message_id])  # "Failed to receive message"
    loop._insert_message(new, state, store)
    fresh = _reply(new)
    assert stale.metadata.message_id in state.msg_store  # type: ignore[attr-defined]
    sent: list[tuple[int, str]] = []

    def send(message: object, tree: object, runtime: float) -> tuple[set[str], str]:
        sent.append((message.metadata.run_id, message.metadata.reply_to_message_id))  # type: ignore[attr-defined]
        return set(), "session"

    class WorkerRepliesWhileWaiting:  # the worker's reply lands during the push's first wait, in either code
        def sleep(self, _: float) -> None:
            loop._insert_message(fresh, state, store)

        def __getattr__(self, name: str) -> object:
            return getattr(__import__("time"), name)

    monkeypatch.setattr(agent, "time", WorkerRepliesWhileWaiting())
    monkeypatch.setattr(loop, "time", WorkerRepliesWhileWaiting())
    flowers = getattr(loop._push_messages, "__wrapped__", loop._push_messages)  # as Flower 1.42 ships it
    push = agent._fresh_replies_first(flowers) if wrapped else flowers

    # Execute: one push after the pull of round 7
    push(state, store, send, lambda *_: None)

    # Assert: Flower's own push sends the stale reply (one the standby's SuperLink cannot know) and leaves round
    # 7's for the next pull; the wrapped push drops the stale one and sends round 7's now
    if wrapped:
        assert sent == [(222, new.metadata.message_id)]
        assert stale.metadata.message_id not in state.msg_store
    else:
        assert sent == [(111, old.metadata.message_id)]  # type: ignore[attr-defined]
        # round 7 still awaits its reply, which goes with the next message pulled: one round late, and on after
        assert new.metadata.message_id in state.msg_store  # type: ignore[attr-defined]


def test_only_flowers_idle_and_reply_sleeps_are_shortened(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr("time.sleep", slept.append)  # the sleeps are what is tested: record, never wait
    clock = _PollClock(0.2)

    clock.sleep(IDLE_SLEEP_S)
    clock.sleep(REPLY_SLEEP_S)
    clock.sleep(7.0)

    assert slept == [0.2, 0.02, 7.0]
    assert clock.monotonic is not None  # everything else is the time module's


def _state(round_: int) -> ServerState:
    return ServerState(params=np.zeros(3, np.float32), round=round_)


def test_a_serverapp_that_lost_the_lease_can_neither_commit_nor_change_status(db_url: str) -> None:
    # Prepare: the old ServerApp opened the run; the restarted one took it over
    old, new = TakenRunStore(db_url), TakenRunStore(db_url)
    run_id = old.create_run(name="r", scenario={}, seed=1, strategy="fedavg", rounds=3, engine="deployment")
    old.take(run_id)
    new.take(run_id)
    record = RoundRecord(round=1, started_at=0.0, duration_s=1.0, sampled=0, clients=[])

    # Execute / Assert
    with pytest.raises(LeaseLost):
        old.commit_round(run_id, record, _state(1))
    with pytest.raises(LeaseLost):
        old.set_status(run_id, "failed", "SystemExit: 1")
    lease = new.get_run(run_id).lease_until
    old.renew_lease(run_id, 1e6)  # refused without a word: the lease is not the old process's to extend
    assert new.get_run(run_id).lease_until == lease
    new.commit_round(run_id, record, _state(1))
    assert [r.round for r in new.rounds(run_id)] == [1]
    assert new.get_run(run_id).status == "running"
    new.renew_lease(run_id, 1e6)
    assert new.get_run(run_id).lease_until > new.clock() + 1e5
    # a plain store (no holder: a reader, or a Quorum before take-over) is not fenced out of a run
    assert RunStore(db_url).get_run(run_id).holder == new.holder


def test_runs_a_crash_interrupted_are_resumed_and_others_are_not(db_url: str) -> None:
    store = TakenRunStore(db_url)
    ids = {}
    for name, status, error in (("killed", "running", None), ("stopped", "interrupted", None),
                                ("exit", "failed", "SystemExit: 1"), ("bug", "failed", "ValueError: x"),
                                ("done", "finished", None)):
        ids[name] = store.create_run(name=name, scenario={}, seed=1, strategy="fedavg", rounds=3,
                                     engine="deployment")
        if status != "running":
            store.set_status(ids[name], status, error)
    other = store.create_run(name="sim", scenario={}, seed=1, strategy="fedavg", rounds=3, engine="inprocess")

    found = set(resumable_runs(db_url))

    assert found == {ids["killed"], ids["stopped"], ids["exit"]}
    assert other not in found


def test_a_standby_resumes_only_its_own_federations_runs(db_url: str) -> None:
    from aggregator.serverapp import _deployed_start
    from tests.conftest import tiny_scenario

    # Prepare: three runs opened by deployment ServerApps of two federations sharing one database, and one
    # submitted by a Quorum from before the federation was recorded
    store = TakenRunStore(db_url)
    scenario = tiny_scenario()
    ids = {}
    for n, federation in enumerate(("north", "south", "")):
        ids[federation] = store.create_run(name=federation or "old", scenario={}, seed=1, strategy="fedavg",
                                           rounds=3, engine="deployment")
        _, on_start = _deployed_start(_Grid([scenario.federation.clients]), store, scenario,
                                      {"federation": federation, "devices": "{}", "orgs": '{"dev0": "north"}'},
                                      flower_run=n + 1, wait_s=1.0)
        on_start(ids[federation])

    # Execute / Assert: each federation's standby takes its own runs and the unrecorded one, never the other's
    assert RunStore(db_url).get_run(ids["north"]).info["federation"] == "north"
    assert RunStore(db_url).get_run(ids["south"]).info["orgs"] == {"dev0": "north"}  # whose rows are whose
    assert set(resumable_runs(db_url, "north")) == {ids["north"], ids[""]}
    assert set(resumable_runs(db_url, "south")) == {ids["south"], ids[""]}
    assert set(resumable_runs(db_url)) == set(ids.values())


class _Grid:
    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def get_node_ids(self) -> list[int]:
        return list(range(self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]))


def test_a_run_waits_for_the_whole_federation_then_settles_for_min_clients() -> None:
    assert wait_for_nodes(_Grid([1, 2, 3]), want=3, least=2, timeout_s=5, poll_s=0.0) == 3
    assert wait_for_nodes(_Grid([2]), want=3, least=2, timeout_s=0.05, poll_s=0.01) == 2
    assert wait_for_nodes(_Grid([1]), want=3, timeout_s=0.05, poll_s=0.01) == 1  # least 0: what is there


def test_too_few_clients_past_the_grace_is_an_error_naming_the_counts() -> None:
    # the grace is as long as the wait again, at least 60 s: a clock that jumps makes it pass at once
    times = iter([0.0, 0.0, 30.0, 200.0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("aggregator.serverapp.time.monotonic", lambda: next(times))
        with pytest.raises(TooFewClients, match="only 1 of the 2 clients the scenario needs connected within 70 s"):
            wait_for_nodes(_Grid([1]), want=3, least=2, timeout_s=10, poll_s=0.0)


@pytest.mark.parametrize(("key", "value"), [("wait_clients_s", "nan"), ("wait_clients_s", "inf"),
                                            ("wait_clients_s", "1e308"), ("wait_clients_s", "-1"),
                                            ("rate_limit", "10000000000000000000000")])
def test_a_federation_setting_beyond_its_range_is_one_line_naming_it(tmp_path: Path, key: str, value: str) -> None:
    from deploy.config import load_config
    from deploy.errors import ConfigError

    path = tmp_path / "federation.toml"
    path.write_text(f"[aggregator]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"aggregator\.{key} = .*: .*in \[0, "):
        load_config(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e308, -1.0, "120", True])
def test_a_run_configs_wait_for_clients_beyond_a_week_or_not_seconds_is_refused(value: object) -> None:
    from aggregator.serverapp import _wait_seconds
    from scenarios.errors import ScenarioError

    with pytest.raises(ScenarioError, match="run config wait-clients-s = .*: must be seconds in \\[0, 604,800\\]"):
        _wait_seconds({"wait-clients-s": value})
    assert _wait_seconds({}) == 60.0 and _wait_seconds({"wait-clients-s": 0}) == 0.0
