"""Talking to Flower's processes and CLI on the aggregator host.

Everything here goes to the SuperLink's loopback listener: the Control API
(``flwr run``, ``flwr supernode register``) is never reachable from devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import deploy
from deploy.config import APP_CONFIG, DeployConfig
from deploy.errors import DeployError
from deploy.pki import TlsFiles

__all__ = ["CONNECTION", "flower_env", "write_flower_home", "superlink_command", "write_app", "stop_run",
           "flwr", "FlwrResult", "register_key", "unregister_node", "list_nodes", "submit_run", "bin_path"]

CONNECTION = "quorum-local"
REPO_ROOT = Path(deploy.__file__).resolve().parent.parent

_QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
          # SuperExec (on the aggregator: the ServerApp launcher) looks for new runs every 0.2 s, not 1 s
          "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"}


def bin_path(name: str) -> str:
    """A console script of this Python environment (Flower's, Quorum's)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def flower_env(config: DeployConfig, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for Flower processes: its own FLWR_HOME, quiet, Quorum importable."""
    env = dict(os.environ)
    env.update(_QUIET)
    env["FLWR_HOME"] = str(config.state.flwr_home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # The ServerApp imports Quorum from this installation, not from the (code-free) app bundle.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def write_flower_home(config: DeployConfig, tls: TlsFiles | None) -> Path:
    """``$FLWR_HOME/config.toml`` with one connection: this host's SuperLink on loopback."""
    home = config.state.flwr_home
    home.mkdir(parents=True, exist_ok=True)
    auth = f'root-certificates = "{tls.ca_cert}"\n' if tls else "insecure = true\n"
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "{config.control_address}"\n{auth}')
    return home


def superlink_command(config: DeployConfig, tls: TlsFiles | None) -> list[str]:
    """The SuperLink on 127.0.0.1 only, its state in a database file (node keys and ids survive restarts)."""
    config.state.linkstate.parent.mkdir(parents=True, exist_ok=True)
    cmd = [bin_path("flower-superlink"), "--host", "127.0.0.1", "--port", str(config.aggregator.internal_port),
           "--database", str(config.state.linkstate), "--disable-runtime-dependency-installation"]
    if tls is None:
        return [*cmd, "--insecure"]
    return [*cmd, "--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
            "--ssl-keyfile", str(tls.server_key), "--enable-supernode-auth"]


def write_app(config: DeployConfig) -> Path:
    """The Flower App ``flwr run`` bundles: configuration only, no code.

    The ServerApp and ClientApp are imported from each side's own Quorum
    installation, so a device runs only code it installed itself.
    """
    app = config.state.app
    app.mkdir(parents=True, exist_ok=True)
    lines = [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in APP_CONFIG.items()]
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "quorum-deployment"\nversion = "1.0.0"\n'
        'description = "Quorum federated run"\nlicense = "Apache-2.0"\ndependencies = []\n\n'
        '[tool.flwr.app]\npublisher = "quorum"\n\n'
        '[tool.flwr.app.components]\nserverapp = "deploy.serverapp:app"\n'
        'clientapp = "clients.clientapp:app"\n\n'
        '[tool.flwr.app.config]\n' + "\n".join(lines) + "\n")
    return app


@dataclass(frozen=True)
class FlwrResult:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict:
        try:
            return json.loads(self.stdout)
        except json.JSONDecodeError:
            raise DeployError(f"flwr printed no JSON (rc {self.returncode}): "
                              f"{(self.stderr or self.stdout).strip()[-400:]}") from None


def flwr(config: DeployConfig, args: Sequence[str], timeout_s: float = 120.0) -> FlwrResult:
    """Run the ``flwr`` CLI against this host's SuperLink."""
    try:
        done = subprocess.run([bin_path("flwr"), *args], env=flower_env(config), capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise DeployError(f"flwr {' '.join(args[:2])} did not answer within {timeout_s:g} s") from None
    return FlwrResult(done.returncode, done.stdout, done.stderr)


def register_key(config: DeployConfig, public_key: Path, name: str) -> int:
    """``flwr supernode register``; returns the node id the SuperLink assigned."""
    out = flwr(config, ["supernode", "register", str(public_key), CONNECTION, "--name", name,
                        "--format", "json"]).json()
    if not out.get("success"):
        why = str(out.get("error-message", out))
        if "already in use" in why.lower():  # Flower keeps every key it ever registered, revoked ones too
            raise DeployError(f"the SuperLink refused the key: {why}. This key was enrolled before (now, under "
                              "another name, or a revoked device's) and cannot be enrolled again: make a new one on "
                              f"the device (quorum client keygen NEW.key) and enroll {name} with --public-key "
                              "NEW.key.pub")
        raise DeployError(f"the SuperLink refused the key: {why}")
    return int(out["node-id"])


def unregister_node(config: DeployConfig, node_id: int) -> None:
    out = flwr(config, ["supernode", "unregister", str(node_id), CONNECTION, "--format", "json"]).json()
    if not out.get("success"):
        raise DeployError(f"the SuperLink did not unregister node {node_id}: {out.get('error-message', out)}")


def stop_run(config: DeployConfig, flower_run_id: int) -> bool:
    """``flwr stop``: end a Flower run; False if the SuperLink did not (it may be over already)."""
    return flwr(config, ["stop", str(flower_run_id), CONNECTION, "--format", "json"], timeout_s=30.0).returncode == 0


def list_nodes(config: DeployConfig) -> list[dict]:
    out = flwr(config, ["supernode", "list", CONNECTION, "--format", "json"]).json()
    if not out.get("success"):
        raise DeployError(f"cannot list nodes: {out.get('error-message', out)}")
    return list(out.get("nodes", []))


def submit_run(config: DeployConfig, run_config: Mapping[str, str | float | int]) -> int:
    """``flwr run`` the deployment app with ``run_config``; returns the Flower run id."""
    app = write_app(config)
    # A TOML file, not `k=v` pairs: Flower splits pairs on spaces and quotes, and
    # an inline scenario is JSON full of both. JSON strings are valid TOML strings.
    overrides = config.state.app / "run-config.toml"
    overrides.write_text("".join(f"{json.dumps(k)} = {json.dumps(v)}\n" for k, v in run_config.items()))
    result = flwr(config, ["run", str(app), CONNECTION, "--run-config", str(overrides), "--format", "json"])
    out = result.json()
    if not out.get("success"):
        raise DeployError(f"flwr run failed: {out.get('error-message', out)}")
    return int(out["run-id"])
