"""An edge aggregator's host without a running federation: its options, its upstream agent, its bridge."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from core.channel import Channel
from deploy.agent import AgentSpec, supernode_argv
from deploy.config import APP_CONFIG, load_config
from deploy.edge import START_GRACE_S, EdgeBridge, EdgeSpec, channel_of, upstream_agent_argv
from deploy.errors import DeployError


def _config(tmp_path: Path) -> Any:
    path = tmp_path / "edge.toml"
    path.write_text('[aggregator]\nname = "edge-a"\nstate_dir = "state"\n')
    return load_config(path)


@pytest.mark.parametrize(("spec", "why"), [
    (EdgeSpec("no-port", "e"), "expected HOST:PORT"),
    (EdgeSpec("h:99999", "e"), "expected HOST:PORT"),
    (EdgeSpec("h:1", "e"), "--upstream-key is required"),
    (EdgeSpec("h:1", "e", key=Path("/nonexistent.key"), ca=Path("/nonexistent.pem")), "no such file"),
], ids=["no-port", "port-out-of-range", "no-key", "missing-files"])
def test_an_edge_that_cannot_reach_its_aggregator_is_refused_naming_the_option(spec: EdgeSpec, why: str) -> None:
    with pytest.raises(DeployError, match=why):
        spec.check()


def test_an_insecure_loopback_edge_needs_no_key_and_a_remote_one_is_refused() -> None:
    EdgeSpec("127.0.0.1:9092", "e", insecure=True).check()
    with pytest.raises(DeployError, match="loopback aggregator only"):
        EdgeSpec("10.0.0.7:9092", "e", insecure=True).check()


@pytest.mark.parametrize(("args", "why"), [
    (["--upstream", "h:1"], "--upstream is an edge aggregator's option: add --edge"),
    (["--edge"], "--edge needs --upstream HOST:PORT"),
    (["--edge", "--standby", "--upstream", "h:1"], "an edge aggregator has no standby"),
    (["--edge", "--upstream", "h:1"], "--upstream-key is required"),
    (["--edge", "--insecure", "--upstream", "127.0.0.1:1", "--upstream-key", "k"], "are for TLS"),
], ids=["upstream-alone", "edge-without-upstream", "edge-standby", "edge-without-key", "insecure-with-key"])
def test_edge_flags_that_do_not_fit_are_refused_before_anything_starts(tmp_path: Path, args: list[str],
                                                                       why: str) -> None:
    from deploy.cli import app

    config = tmp_path / "edge.toml"
    config.write_text('[aggregator]\nname = "edge-a"\nstate_dir = "state"\n')
    result = CliRunner().invoke(app, ["start", "-c", str(config), *args])
    assert result.exit_code == 2, result.output
    assert why in " ".join(result.output.split())
    assert not (tmp_path / "state" / "superlink").exists()  # nothing was started


def test_the_upstream_agent_is_a_data_less_device_of_the_aggregator(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    key, ca = tmp_path / "edge-a.key", tmp_path / "ca.pem"
    argv = upstream_agent_argv(cfg, EdgeSpec("10.0.0.1:9092", "edge-a", key=key, ca=ca))
    assert argv[1:5] == ["-m", "deploy", "client", "start"]
    flags = dict(zip(argv[5::2], argv[6::2], strict=False))
    assert flags["--server"] == "10.0.0.1:9092" and flags["--name"] == "edge-a"
    assert flags["--edge-channel"] == str(channel_of(cfg).root)
    assert flags["--key"] == str(key.resolve()) and flags["--ca"] == str(ca.resolve())
    # its SuperNode tells the ClientApp it is an edge, and names no data
    spec = AgentSpec(server="h:1", data=channel_of(cfg).root, key=key, ca=ca, name="edge-a",
                     edge_channel=channel_of(cfg).root)
    node_config = supernode_argv(spec)[supernode_argv(spec).index("--node-config") + 1]
    assert f'edge-channel="{channel_of(cfg).root.resolve()}"' in node_config
    assert "data-path" not in node_config


def test_the_upstream_agent_refuses_to_start_without_data_unless_an_edge(tmp_path: Path) -> None:
    from deploy.agent_cli import app

    result = CliRunner().invoke(app, ["start", "--server", "h:1", "--insecure"])
    assert result.exit_code != 0
    assert "--data is required" in result.output


def _ask(channel: Channel, run: int, config: dict[str, Any]) -> None:
    """Leave a request of ``run`` waiting, as the upstream ClientApp does (its asker gave up at once)."""
    channel._run_file(run).parent.mkdir(parents=True, exist_ok=True)
    channel._run_file(run).write_text(json.dumps(config))
    request = channel.root / "requests" / str(run) / "r1.msg"
    request.parent.mkdir(parents=True, exist_ok=True)
    request.write_bytes(b"")


def test_the_bridge_serves_each_waiting_run_once_with_the_aggregators_scenario(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    submitted: list[dict[str, Any]] = []

    def submit(_: Any, run_config: dict[str, Any]) -> int:
        submitted.append(run_config)
        return 77

    bridge = EdgeBridge(cfg, EdgeSpec("h:1", "edge-a", insecure=True), submit, say=lambda _: None)
    assert bridge.poll() == []  # nothing waits
    upstream_run = 2**64 - 3  # a Flower run id past int64
    _ask(bridge.channel, upstream_run, {"scenario-json": "{\"name\": \"s\"}", "db": "postgresql://secret@top/q",
                                        "state-dir": "/top/state", "overrides": "{}"})
    assert bridge.poll() == [77]
    assert bridge.poll() == []  # served: not submitted again while its ServerApp starts
    (config,) = submitted
    assert config["scenario-json"] == "{\"name\": \"s\"}" and config["overrides"] == "{}"
    assert config["edge-run"] == str(upstream_run) and config["edge-name"] == "edge-a"
    assert config["edge-channel"] == str(bridge.channel.root)
    assert config["state-dir"] == str(cfg.state.root)  # the edge's own logs, not the aggregator's folder
    assert "db" not in config  # the aggregator's store stays the aggregator's
    assert (bridge.channel.root / "names.json").exists()  # the edge's device names, for its ServerApps
    assert set(config) <= set(APP_CONFIG)  # Flower refuses an undeclared run config key


def test_the_bridge_starts_another_server_once_the_last_one_is_gone(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tmp_path)
    runs = iter([5, 6])
    bridge = EdgeBridge(cfg, EdgeSpec("h:1", "edge-a", insecure=True), lambda *_: next(runs), say=lambda _: None)
    _ask(bridge.channel, 9, {"scenario-json": "{}"})
    assert bridge.poll() == [5]
    clock = [0.0]
    monkeypatch.setattr("deploy.edge.time.monotonic", lambda: clock[0])
    bridge.serving[9] = (5, 0.0)
    clock[0] = START_GRACE_S - 1
    assert bridge.poll() == []  # still starting
    clock[0] = START_GRACE_S + 1
    folder = cfg.state.root / "serverapps"
    folder.mkdir(parents=True)
    (folder / "1.json").write_text(json.dumps({"pid": os.getpid(), "flower_run": 5}))
    assert bridge.poll() == []  # its ServerApp is alive
    (folder / "1.json").unlink()
    assert bridge.poll() == [6]  # gone (idle, or killed): the run is served again


def test_a_failed_submission_is_said_and_tried_again_later_without_stopping_the_host(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    said: list[str] = []

    def submit(*_: Any) -> int:
        raise ValueError("Value out of range: 14323078023864829063")

    bridge = EdgeBridge(cfg, EdgeSpec("h:1", "edge-a", insecure=True), submit, say=said.append)
    _ask(bridge.channel, 3, {"scenario-json": "{}"})
    assert bridge.poll() == []
    assert bridge.poll() == []  # not every half second: after START_GRACE_S
    assert len(said) == 1 and "could not start serving the aggregator's run 3" in said[0]


def test_a_request_without_its_run_config_is_not_served(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    bridge = EdgeBridge(cfg, EdgeSpec("h:1", "edge-a", insecure=True), lambda *_: 1, say=lambda _: None)
    request = bridge.channel.root / "requests" / "4" / "r.msg"
    request.parent.mkdir(parents=True)
    request.write_bytes(b"")
    assert bridge.poll() == []


def test_a_run_the_edges_site_policy_refuses_is_answered_with_why_and_never_served(tmp_path: Path) -> None:
    import json as json_
    import threading

    from core.errors import EdgeUnavailable
    from tests.conftest import tiny_scenario

    cfg = _config(tmp_path)
    policy = tmp_path / "policy.toml"
    policy.write_text("require_secure_aggregation = true\n")
    submitted: list[dict[str, Any]] = []
    said: list[str] = []
    bridge = EdgeBridge(cfg, EdgeSpec("127.0.0.1:1", "edge-a", insecure=True, policy=policy),
                        lambda _, config: submitted.append(config) or 1, say=said.append)
    run_config = {"scenario-json": json_.dumps(tiny_scenario().to_dict())}  # no [secagg]: the policy refuses it
    errors: list[BaseException] = []

    def ask() -> None:
        from flwr.app import RecordDict

        try:
            bridge.channel.ask(8, "train.edge", RecordDict(), timeout_s=20.0, run_config=run_config)
        except EdgeUnavailable as exc:
            errors.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    for _ in range(400):
        bridge.poll()
        if errors or not asker.is_alive():
            break
        threading.Event().wait(0.02)
    asker.join(timeout=30)
    assert submitted == []  # no ServerApp of the edge ever serves it
    assert errors and "edge edge-a refused the run: site policy" in str(errors[0])
    assert "secure aggregation" in str(errors[0])
    assert len(said) == 1 and "refused" in said[0]


def test_a_bad_edge_policy_is_refused_naming_it(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text("max_epsilon = -1\n")
    with pytest.raises(DeployError, match="--edge-policy"):
        EdgeSpec("127.0.0.1:1", "e", insecure=True, policy=policy).check()
