"""Talking to Flower's processes and CLI on the aggregator host.

Everything here goes to the SuperLink's loopback listener: the Control API
(what ``flwr run`` and ``flwr supernode register`` call, called here in
process) is never reachable from devices.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deploy
from deploy.config import APP_CONFIG, DeployConfig
from deploy.errors import DeployError
from deploy.pki import TlsFiles

if TYPE_CHECKING:
    from flwr.proto.node_pb2 import NodeInfo
    from flwr.supercore.control import ControlHttpClient

__all__ = ["CONNECTION", "warm_up", "stop_unfinished_runs", "flower_env", "write_flower_home", "superlink_command",
           "write_app", "stop_run", "control", "register_key", "unregister_node", "node_infos", "list_nodes",
           "submit_run", "bin_path"]

CONNECTION = "quorum-local"
REPO_ROOT = Path(deploy.__file__).resolve().parent.parent

_QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
          # SuperExec (on the aggregator: the ServerApp launcher) looks for new runs every 0.5 s, not 1 s: a
          # run starts at most 0.5 s after its submission; at 0.2 s an idle aggregator host spent a few
          # per cent of a core on the polling alone
          "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.5"}


def bin_path(name: str) -> str:
    """Return the path of a console script of this Python environment (Flower's, Quorum's), else its bare name."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else name


def flower_env(config: DeployConfig, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Build the environment for Flower processes: its own FLWR_HOME, quiet, Quorum importable."""
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
    """Build the SuperLink's command: on 127.0.0.1 only, its state in a database file.

    Node keys and ids survive restarts.
    """
    config.state.linkstate.parent.mkdir(parents=True, exist_ok=True)
    cmd = [bin_path("flower-superlink"), "--host", "127.0.0.1", "--port", str(config.aggregator.internal_port),
           "--database", str(config.state.linkstate), "--disable-runtime-dependency-installation"]
    if tls is None:
        return [*cmd, "--insecure"]
    return [*cmd, "--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert),
            "--ssl-keyfile", str(tls.server_key), "--enable-supernode-auth"]


def write_app(config: DeployConfig) -> Path:
    """Write the Flower App ``flwr run`` bundles (configuration only, no code); return its folder.

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
        '[tool.flwr.app.components]\nserverapp = "aggregator.serverapp:app"\n'
        'clientapp = "clients.clientapp:app"\n\n'
        '[tool.flwr.app.config]\n' + "\n".join(lines) + "\n")
    return app


@contextmanager
def control(config: DeployConfig) -> Iterator[ControlHttpClient]:
    """Open a client of this host's SuperLink Control API, in this process.

    What ``flwr supernode register``, ``flwr run`` and the rest send, without a
    ``flwr`` process per call (about 1.2 s of CPU each, mostly imports): the
    connection is the one ``$FLWR_HOME/config.toml`` names, the interceptors
    are the CLI's own, and a refusal reads as Flower's CLI words it.
    """
    from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    home = config.state.flwr_home / "config.toml"
    try:
        link = tomllib.loads(home.read_text())["superlink"][CONNECTION]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        raise DeployError(f"no SuperLink connection in {home} ({exc}): start the aggregator first "
                          "(quorum aggregator start)") from None
    ca = link.get("root-certificates")  # as bytes: Flower hands a path to httpx, which deprecates that
    client = ControlHttpClient.from_server_address(
        server_address=str(link["address"]), insecure=bool(link.get("insecure", False)),
        root_certificates=Path(ca).read_bytes() if ca else None,
        interceptors=[CliClientHttpInterceptor(), RuntimeVersionHttpInterceptor(component_name="flwr CLI")])
    try:
        yield client
    finally:
        client.close()


@contextmanager
def _refusal(what: str) -> Iterator[None]:
    """Flower's own wording of a Control API error (its CLI's handler), as a DeployError."""
    import click
    from flwr.cli.utils import flwr_cli_exc_handler

    try:
        with flwr_cli_exc_handler():
            yield
    except click.ClickException as exc:
        raise DeployError(f"{what}: {exc.format_message()}") from None


def register_key(config: DeployConfig, public_key: Path, name: str) -> int:
    """``flwr supernode register``; returns the node id the SuperLink assigned."""
    import click
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.proto.control_pb2 import RegisterNodeRequest

    try:
        key = try_load_public_key(Path(public_key).expanduser())
    except click.ClickException as exc:
        raise DeployError(f"cannot enroll {name}: {exc.format_message()}") from None
    try:
        with control(config) as api, _refusal("the SuperLink refused the key"):
            node_id = int(api.RegisterNode(RegisterNodeRequest(public_key=key, name=name)).node_id)
    except DeployError as exc:
        if "already in use" in str(exc).lower():  # Flower keeps every key it ever registered, revoked ones too
            raise DeployError(f"{exc}. This key was enrolled before (now, under another name, or a revoked "
                              "device's) and cannot be enrolled again: make a new one on the device (quorum "
                              f"client keygen NEW.key) and enroll {name} with --public-key NEW.key.pub") from None
        raise
    if not node_id:
        raise DeployError(f"the SuperLink registered no node for {name}")
    return node_id


def unregister_node(config: DeployConfig, node_id: int) -> None:
    """Unregister ``node_id`` from the SuperLink (``flwr supernode unregister``).

    Raises
    ------
    DeployError
        The SuperLink refused, in Flower's CLI words.
    """
    from flwr.proto.control_pb2 import UnregisterNodeRequest

    with control(config) as api, _refusal(f"the SuperLink did not unregister node {node_id}"):
        api.UnregisterNode(UnregisterNodeRequest(node_id=node_id))


def stop_run(config: DeployConfig, flower_run_id: int) -> bool:
    """``flwr stop``: end a Flower run; False if the SuperLink did not (it may be over already)."""
    from flwr.proto.control_pb2 import StopRunRequest

    try:
        with control(config) as api, _refusal(f"cannot stop run {flower_run_id}"):
            return bool(api.StopRun(StopRunRequest(run_id=flower_run_id)).success)
    except DeployError:
        return False


def stop_unfinished_runs(config: DeployConfig, page: int = 100) -> list[int]:
    """Stop every Flower run this host's SuperLink still counts as unfinished; return their ids.

    Called when an aggregator starts, and after its SuperLink restarts, once no
    ServerApp of this host runs: a run its link state still holds as running
    lost its ServerApp with the aggregator or SuperLink that died. Left as it
    was, its undelivered messages went to the devices when they reconnected
    (the link state outlives the SuperLink in the state folder): a device then
    waited some 40 s for the content of a message no ServerApp would ever send,
    and missed the resumed run's round. Quorum's runs are resumed as new Flower
    runs (``resume``), so nothing is lost by stopping these.
    """
    from flwr.common.constant import Status
    from flwr.proto.control_pb2 import ListRunsRequest, StopRunRequest

    stopped: list[int] = []
    with control(config) as api, _refusal("cannot list the SuperLink's runs"):
        unfinished, skip = [], 0
        while True:
            runs = api.ListRuns(ListRunsRequest(limit=page, skip=skip)).run_dict
            unfinished += [run_id for run_id, run in runs.items() if run.status.status != Status.FINISHED]
            if len(runs) < page:
                break
            skip += page
        for run_id in unfinished:
            with contextlib.suppress(DeployError), _refusal(f"cannot stop run {run_id}"):
                if api.StopRun(StopRunRequest(run_id=run_id)).success:
                    stopped.append(int(run_id))
    return stopped


def node_infos(config: DeployConfig) -> list[NodeInfo]:
    """Return the SuperLink's records of its nodes (Control API ``ListNodes``: id, owner, status, public key)."""
    from flwr.proto.control_pb2 import ListNodesRequest

    with control(config) as api, _refusal("cannot list nodes"):
        return list(api.ListNodes(ListNodesRequest()).nodes_info)


def list_nodes(config: DeployConfig) -> list[dict[str, Any]]:
    """``flwr supernode list --format json``'s rows: ``node-id``, ``owner-name``, ``status``."""
    return [{"node-id": n.node_id, "owner-name": n.owner_name, "status": n.status} for n in node_infos(config)]


def warm_up() -> None:
    """Import what :func:`control` and :func:`submit_run` use (half a second idle, seconds on a loaded host)."""
    import flwr.cli.build
    import flwr.cli.cli_client_interceptor
    import flwr.common.serde
    import flwr.proto.control_pb2
    import flwr.supercore.control
    import flwr.supercore.fab
    import flwr.supercore.interceptors  # noqa: F401


def submit_run(config: DeployConfig, run_config: Mapping[str, str | float | int]) -> int:
    """``flwr run`` the deployment app with ``run_config``; returns the Flower run id."""
    import hashlib

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.serde import fab_to_proto, user_config_to_proto
    from flwr.proto.control_pb2 import StartRunRequest
    from flwr.supercore.fab import Fab

    fab = build_fab_from_disk(write_app(config))
    request = StartRunRequest(fab=fab_to_proto(Fab(hashlib.sha256(fab).hexdigest(), fab, {})),
                              override_config=user_config_to_proto(dict(run_config)), federation="")
    with control(config) as api, _refusal("flwr run failed"):
        response = api.StartRun(request)
    if not response.HasField("run_id"):
        note = f" ({response.note})" if response.HasField("note") else ""
        raise DeployError(f"flwr run failed: the SuperLink started no run{note}")
    return int(response.run_id)
