"""``quorum client``: enroll and revoke devices (on the aggregator), run the agent (on a device)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.text import Text

__all__ = ["app"]

app = typer.Typer(help="Edge devices: enroll/revoke their keys (on the aggregator), start the agent "
                       "(on the device).", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False)
console = Console(stderr=True, markup=False, highlight=False)  # every text printed as it is

ConfigOption = Annotated[Path | None, typer.Option(
    "--config", "-c", help="The aggregator's federation.toml.", envvar="QUORUM_FEDERATION")]


def _fail(message: str) -> NoReturn:
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(2)


@app.command()
def enroll(
    name: Annotated[str, typer.Argument(help="The device's name, e.g. hospital-a.")],
    config: ConfigOption = None,
    public_key: Annotated[Path | None, typer.Option(
        help="The device's own public key (OpenSSH, ECDSA P-384). Without it a key pair is made here.")]
    = None,
    secagg_public_key: Annotated[Path | None, typer.Option(
        help="The device's own secure-aggregation identity, a file holding its Ed25519 public key as 64 hex "
             "digits. Without it one is made here.")] = None,
    org: Annotated[str, typer.Option(
        help="The organisation (site) that owns the device: accounts of that organisation see its per-client "
             "rows on the dashboard (quorum accounts). Without it, only admins see them.")] = "",
) -> None:
    """Register a device with the running aggregator and print what the device needs (run on the aggregator).

    The device's key goes to the running aggregator and its secure-aggregation
    identity into the enrolment directory.
    """
    from core.errors import QuorumError
    from deploy.config import load_config
    from deploy.enroll import directory_path
    from deploy.enroll import enroll as do_enroll

    try:
        cfg = load_config(config)
        done = do_enroll(cfg, name, public_key, secagg_public_key, org)
    except QuorumError as exc:
        _fail(str(exc))
    d = done.device
    print(f"enrolled {d.name}: node {d.node_id}, key {d.fingerprint}, "
          f"secure-aggregation identity {d.secagg_public_key[:16]}...", flush=True)
    ca, directory = cfg.state.tls / "ca.pem", directory_path(cfg)
    made = [p for p in (done.private_key, done.secagg_identity) if p is not None]
    print(f"copy to the device: {' '.join(str(p) for p in [ca, directory, *made])}", flush=True)
    for path in made:
        print(f"  ({path.name} was made here: copy it securely, then delete {path})", flush=True)
    print(f"  ({directory.name} changes with every enrolment: give every device the current one, "
          "by a channel the aggregator does not control)", flush=True)
    key = done.private_key.name if done.private_key else "YOUR-PRIVATE-KEY"
    identity = done.secagg_identity.name if done.secagg_identity else "YOUR-SECAGG-KEY"
    print(f"on the device run:  quorum client start --server {cfg.device_address} --data YOUR-DATA.csv "
          f"--key {key} --ca ca.pem --name {d.name} --secagg-identity {identity} "
          f"--secagg-directory {directory.name}", flush=True)


@app.command()
def revoke(
    name: Annotated[str, typer.Argument(help="The device to remove.")],
    config: ConfigOption = None,
) -> None:
    """Unregister a device's key: the aggregator refuses it from now on (run on the aggregator)."""
    from core.errors import QuorumError
    from deploy.config import load_config
    from deploy.enroll import revoke as do_revoke

    try:
        device = do_revoke(load_config(config), name)
    except QuorumError as exc:
        _fail(str(exc))
    print(f"revoked {device.name} (node {device.node_id}, key {device.fingerprint})", flush=True)


@app.command()
def keygen(
    path: Annotated[Path, typer.Argument(help="Where to write the private key (the public one gets .pub).")],
    name: Annotated[str, typer.Option(help="Comment in the public key.")] = "quorum-device",
    secagg: Annotated[bool, typer.Option(
        "--secagg", help="Make the secure-aggregation identity instead (Ed25519, hex): enroll it with "
                         "--secagg-public-key PATH.pub, so the aggregator never holds this device's signing key.")]
    = False,
) -> None:
    """Make this device's key pair; send only the .pub file to the aggregator (run on the device)."""
    from deploy.pki import make_node_key, public_key_fingerprint
    from privacy.secagg.identity import write_identity

    if path.exists():
        _fail(f"{path} exists; not overwriting a key")
    if secagg:
        public = write_identity(path)
        print(f"secure-aggregation identity {path} (stays here, 0600), public key {public} "
              f"({public.read_text().strip()[:16]}...)", flush=True)
        return
    key = make_node_key(path, name)
    print(f"private key {key.private} (stays here), public key {key.public} "
          f"({public_key_fingerprint(key.public_openssh)})", flush=True)


def _preflight(server: str, ca: Path | None, runtime_port: int | None, workdir: Path,
               data: Path | None) -> tuple[int, Any]:
    """Run the checks before joining (docs/deploy.md, section 4); return the runtime port and the held workdir lock."""
    from deploy.preflight import PreflightError, check_ca, check_data, check_port, free_port, lock_workdir

    port = free_port() if runtime_port is None else runtime_port
    try:
        lock = lock_workdir(workdir)
        if runtime_port is not None:
            check_port(port)
        warning = None if ca is None else check_ca(server, ca)
    except PreflightError as exc:
        _fail(str(exc))
    for line in ([warning] if warning else []) + (check_data(data) if data is not None else []):
        console.print(f"warning: {line}", markup=False, style="yellow")
    return port, lock


@app.command()
def start(
    server: Annotated[str, typer.Option(help="The aggregator's device address, HOST:PORT.")],
    data: Annotated[Path | None, typer.Option(
        help="This device's data (CSV, NPZ, or text: a file or a folder); it stays. Required.")] = None,
    key: Annotated[Path | None, typer.Option(help="This device's private key.")] = None,
    ca: Annotated[Path | None, typer.Option(help="The federation's CA certificate (ca.pem).")] = None,
    name: Annotated[str, typer.Option(help="The name this device was enrolled under.")] = "",
    insecure: Annotated[bool, typer.Option(help="No TLS (a loopback trial aggregator only).")] = False,
    runtime_port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="Local port between SuperNode and worker (127.0.0.1); default: a free one.")] = None,
    poll: Annotated[float, typer.Option(help="Seconds between polls while idle (Flower's default: 3).")] = 1.0,
    reconnect_max: Annotated[float, typer.Option(
        help="While the aggregator cannot be reached, the longest wait between two tries (each a random "
             "wait up to a doubling bound: Flower's own is 20). Lower: back sooner after an aggregator "
             "fails over; higher: fewer tries from a large fleet while it is down.")] = 4.0,
    workdir: Annotated[Path, typer.Option(help="Logs and Flower's state.")] = Path(".quorum-agent"),
    task_input_timeout: Annotated[float, typer.Option(
        help="Seconds one task waits for its model to arrive from the SuperNode before it fails and the "
             "worker takes the next task (Flower's ClientApp waits 2 hours). Raise it on slow links "
             "with large models.")] = 20.0,
    secagg_identity: Annotated[Path | None, typer.Option(
        help="Secure aggregation: this device's enrolled Ed25519 identity key (hex, keep it 0600).")] = None,
    secagg_directory: Annotated[Path | None, typer.Option(
        help="Secure aggregation: the operator's enrolment directory (JSON, id -> public key).")] = None,
    policy: Annotated[Path | None, typer.Option(
        help="This device's site policy (policy.toml: secure aggregation required, DP budget, cohort, tasks, "
             "rounds a day), enforced here before the data is read; the aggregator cannot change it. "
             "Default: policy.toml in --workdir, when there is one.")] = None,
    edge_channel: Annotated[Path | None, typer.Option(
        hidden=True, help="An edge aggregator's upstream agent (started by `quorum aggregator start --edge`): "
                          "no data; the aggregator's messages go to the edge through this folder.")] = None,
) -> None:
    """Run the client agent: a SuperNode plus a warm ClientApp worker, restarted if they die (run on the device)."""
    from deploy.agent import AgentSpec, run_agent

    if edge_channel is not None:
        edge_channel.mkdir(parents=True, exist_ok=True)
        data = edge_channel  # an edge trains nothing here: its devices hold the data
    elif data is None:
        _fail("--data is required: this device's data file or folder (CSV, NPZ, or text)")
    assert data is not None
    if not data.exists():
        _fail(f"--data {data}: no such file or folder")
    if insecure:
        console.print(Text.assemble(("WARNING:", "bold yellow"), " --insecure: no TLS, no authentication; the model "
                                    "and updates cross the network in clear. Only for a loopback trial."))
    elif key is None or ca is None:
        _fail("--key and --ca are required (or --insecure for a loopback trial)")
    for path in (key, ca, secagg_identity, secagg_directory):
        if path is not None and not path.is_file():
            _fail(f"{path}: no such file")
    if not 0.05 <= poll <= 30:
        _fail(f"--poll {poll}: between 0.05 and 30 seconds")
    if not 0.5 <= reconnect_max <= 600:
        _fail(f"--reconnect-max {reconnect_max}: between 0.5 and 600 seconds")
    if task_input_timeout <= 0:
        _fail(f"--task-input-timeout {task_input_timeout}: must be a positive number of seconds")
    policy, rules = _site_policy(policy, workdir)
    port, _lock = _preflight(server, None if insecure else ca, runtime_port, workdir,
                             None if edge_channel is not None else data)
    spec = AgentSpec(server=server, data=data, key=key, ca=ca, name=name, runtime_port=port,
                     poll_s=poll, insecure=insecure, workdir=workdir, task_input_s=task_input_timeout,
                     reconnect_max_s=reconnect_max,
                     secagg_identity=secagg_identity, secagg_directory=secagg_directory, policy=policy,
                     edge_channel=edge_channel)
    print(f"client agent {name or '(unnamed)'}: connecting to {server} (data {data}, logs {workdir / 'logs'})",
          flush=True)
    print(f"site policy: {rules}", flush=True)
    raise typer.Exit(run_agent(spec, say=lambda m: console.print(m, markup=False, highlight=False)))


def _site_policy(given: Path | None, workdir: Path) -> tuple[Path | None, str]:
    """Return the policy file the agent enforces (``given``, else ``WORKDIR/policy.toml`` if there) and its rules.

    A policy that cannot be used stops the agent before it joins, in one line naming the key and value.
    """
    from clients.policy.errors import PolicyError
    from clients.policy.spec import load_policy

    path = given if given is not None else (workdir / "policy.toml" if (workdir / "policy.toml").is_file() else None)
    if path is None:
        return None, "none (every round the aggregator asks for is accepted)"
    if not path.is_file():
        _fail(f"--policy {path}: no such file")
    try:
        return path, f"{path}: {load_policy(path).describe()}"
    except PolicyError as exc:
        _fail(str(exc))


@app.command(name="status")
def agent_status(
    workdir: Annotated[Path, typer.Option(help="The agent's folder (as given to `client start`).")]
    = Path(".quorum-agent"),
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Show whether this device's agent is running, its node id, and how its last tasks ended (run on the device)."""
    import json

    from deploy.agent_console import agent_report

    report = agent_report(workdir)
    if json_out:
        print(json.dumps(report), flush=True)
        return
    running = report["running"]
    console.print(f"agent {'running (pid ' + str(running) + ')' if running else 'not running'} in {workdir}",
                  markup=False)
    console.print(f"node id: {report['node_id'] or 'not connected yet'}", markup=False)
    for line in report["tasks"] or ["no task yet"]:
        console.print(f"  {line}", markup=False)


policy_app = typer.Typer(help="This device's site policy: which runs it accepts, and why not.", no_args_is_help=True,
                         add_completion=False, pretty_exceptions_show_locals=False)
app.add_typer(policy_app, name="policy")


@policy_app.command(name="check")
def policy_check(
    scenarios: Annotated[list[Path] | None, typer.Argument(help="Scenario files to judge.")] = None,
    policy: Annotated[Path, typer.Option(help="The site policy (policy.toml).")] = Path(".quorum-agent/policy.toml"),
    db: Annotated[str | None, typer.Option(help="A run store URL: judge its running runs (the current ones).")]
    = None,
    every: Annotated[bool, typer.Option("--all", help="With --db: every run of the store, not only running ones.")]
    = False,
    rounds_file: Annotated[Path | None, typer.Option(
        help="The device's round count (default: policy-rounds.json beside the policy), for max_rounds_per_day.")]
    = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Say which runs this device's site policy would accept, and why not (run on the device).

    Exits 0 when every run would be accepted, 1 when one would be refused or cannot be judged, 2 on a bad policy.
    """
    import json

    from clients.policy.errors import PolicyError
    from clients.policy.ledger import RoundLedger
    from clients.policy.spec import load_policy
    from core.errors import QuorumError
    from deploy.policy_check import check_scenarios, check_store

    if not scenarios and db is None:
        _fail("give scenario files, or --db URL to judge the runs of a run store")
    try:
        rules = load_policy(policy)
        trained = RoundLedger(rounds_file or policy.with_name("policy-rounds.json")).count() \
            if rules.max_rounds_per_day is not None else 0
    except PolicyError as exc:
        _fail(str(exc))
    verdicts = check_scenarios(rules, scenarios or [], trained)
    if db is not None:
        try:
            verdicts += check_store(rules, db, every, trained)
        except QuorumError as exc:
            _fail(str(exc))
    code = 0 if all(v.accepted for v in verdicts) else 1
    if json_out:
        print(json.dumps({"policy": str(policy), "rules": rules.describe(), "trained_last_24h": trained,
                          "verdicts": [v.to_json() for v in verdicts]}), flush=True)
        raise typer.Exit(code)
    print(f"site policy {policy}: {rules.describe()}", flush=True)
    for verdict in verdicts or []:
        print(verdict.line(), flush=True)
    if not verdicts:
        print("no run to judge", flush=True)
    raise typer.Exit(code)
