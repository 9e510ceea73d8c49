"""``quorum aggregator``: start the aggregator host, submit runs, show its state."""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.text import Text

from core.errors import QuorumError
from core.status import RunStatus
from deploy.config import DeployConfig, load_config
from scenarios.errors import ScenarioError

if TYPE_CHECKING:
    from deploy.edge import EdgeSpec
    from deploy.supervisor import Supervisor
    from runstore.store import Round, Run, RunStore
    from scenarios.schema import Scenario

__all__ = ["app", "ConfigOption"]

app = typer.Typer(help="The aggregator host: SuperLink behind a TLS front door, run store, dashboard.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)
console = Console(stderr=True, markup=False, highlight=False)  # every text printed as it is

ConfigOption = Annotated[Path | None, typer.Option(
    "--config", "-c", help="federation.toml (default: all defaults, state in ./federation).",
    envvar="QUORUM_FEDERATION")]


def _fail(message: str) -> None:
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(2)


def _load(config: Path | None, **overrides: object) -> DeployConfig:
    try:
        cfg = load_config(config)
        given = {k: v for k, v in overrides.items() if v is not None}
        return cfg.with_overrides(**given) if given else cfg
    except QuorumError as exc:
        _fail(str(exc))
        raise  # unreachable


@app.command()
def start(
    config: ConfigOption = None,
    insecure: Annotated[bool | None, typer.Option(
        "--insecure", help="No TLS, no device authentication. Loopback only, for a first try.")] = None,
    port: Annotated[int | None, typer.Option(help="Device-facing port (overrides the file).")] = None,
    resume: Annotated[bool, typer.Option(help="Resume runs a crash interrupted.")] = True,
    detach: Annotated[bool, typer.Option(
        "--detach", help="Run in the background: return once ready (output in STATE_DIR/logs/aggregator.log); "
                         "stop it with `quorum aggregator stop`.")] = False,
    standby: Annotated[bool, typer.Option(
        "--standby", help="Wait while another aggregator leads this federation (same name, same PostgreSQL "
                          "aggregator.database), then take over: start here and resume its runs. See "
                          "docs/deploy.md, 'Two aggregators'.")] = False,
    edge: Annotated[bool, typer.Option(
        "--edge", help="Start an edge aggregator: its own devices enroll here (quorum client enroll -c THIS), "
                       "and it joins the aggregator at --upstream as one device, answering each round with its "
                       "devices' partial sum. See docs/hierarchy.md, 'Deploy an edge'.")] = False,
    upstream: Annotated[str | None, typer.Option(
        help="With --edge: the aggregator's device address, HOST:PORT.")] = None,
    upstream_key: Annotated[Path | None, typer.Option(
        help="With --edge: this edge's key, from `quorum client enroll EDGE` on the aggregator.")] = None,
    upstream_ca: Annotated[Path | None, typer.Option(
        help="With --edge: the aggregator's CA certificate (its ca.pem).")] = None,
    edge_name: Annotated[str | None, typer.Option(
        help="With --edge: the name this edge was enrolled under at the aggregator (default: aggregator.name "
             "of this file).")] = None,
    edge_policy: Annotated[Path | None, typer.Option(
        help="With --edge: this edge's site policy (policy.toml, as a device's: secure aggregation required, "
             "privacy budget, cohort, allowed tasks): a run of the aggregator's that breaks it is refused, and "
             "the aggregator records why for the edge's devices.")] = None,
) -> None:
    """Start the SuperLink, its TLS front door and the dashboard; print what devices need.

    On a PostgreSQL run store only one aggregator of a federation leads: a second start is refused unless it
    is a --standby, which waits and takes over when the leader stops or dies. Exit 1 when this aggregator
    loses the lead (its database connection), 2 on a bad setting or a failed start.
    """
    from deploy.supervisor import Supervisor

    # --insecure also pulls the listener onto loopback; an address beyond it is refused by the config check
    cfg = _load(config, insecure=insecure, port=port, listen="127.0.0.1" if insecure else None)
    edge_spec = _edge_spec(cfg, edge, upstream, upstream_key, upstream_ca, edge_name, standby, edge_policy)
    if detach:
        _detach(cfg.state.logs / "aggregator.log", ready_s=None if standby else 180.0)
        return
    sup = Supervisor(cfg, say=lambda m: console.print(m), resume=resume, standby=standby, edge=edge_spec)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stopping.set())
    try:
        if sup.start():
            _announce(sup)
            if resume:
                sup.resume_interrupted()
            sup.watch()
    except QuorumError as exc:
        sup.stop()
        _fail(str(exc))
    finally:
        sup.stop()
    if sup.lost_lead:
        console.print(Text.assemble(("aggregator stopped:", "bold red"), f" it lost the lead ({sup.lost_lead})"))
        raise typer.Exit(1)
    console.print("aggregator stopped")


def _edge_spec(cfg: DeployConfig, edge: bool, upstream: str | None, key: Path | None, ca: Path | None,
               name: str | None, standby: bool, policy: Path | None = None) -> EdgeSpec | None:
    """Return how an ``--edge`` reaches its aggregator (``None``: not an edge); a wrong combination is refused."""
    from deploy.edge import EdgeSpec
    from deploy.errors import DeployError

    given = [flag for flag, v in (("--upstream", upstream), ("--upstream-key", key), ("--upstream-ca", ca),
                                  ("--edge-name", name), ("--edge-policy", policy)) if v is not None]
    if not edge:
        if given:
            _fail(f"{given[0]} is an edge aggregator's option: add --edge")
        return None
    if standby:
        _fail("--edge and --standby: an edge aggregator has no standby (its devices wait while it restarts)")
    if upstream is None:
        _fail("--edge needs --upstream HOST:PORT, the aggregator's device address")
    if cfg.aggregator.insecure and (key is not None or ca is not None):
        _fail("--upstream-key and --upstream-ca are for TLS, and this edge runs --insecure: drop them, or drop "
              "--insecure")
    spec = EdgeSpec(upstream=str(upstream), name=name or cfg.aggregator.name, key=key, ca=ca,
                    insecure=cfg.aggregator.insecure, policy=policy)
    try:
        spec.check()
    except DeployError as exc:
        _fail(str(exc))
    return spec


#: The last line :func:`_announce` prints: a detached start is ready once its log holds it.
READY_LAST_LINE = "enroll a device:"
#: How a waiting standby's first line starts (``Supervisor._lead``): a detached standby returns there.
STANDBY_LINE = "standby: "


def _detach(log: Path, ready_s: float | None = 180.0) -> None:
    """Start this same command without ``--detach`` in its own session; return once it is ready.

    Its output goes to ``log``; what it printed on the way up is shown here.
    An aggregator that exits first (or is not ready in ``ready_s``) is an
    error quoting the log's end. ``ready_s=None`` (a standby): return once it
    waits for the lead, or is ready.
    """
    import subprocess

    log.parent.mkdir(parents=True, exist_ok=True)
    # the command as this interpreter was started with it (``quorum ...`` or ``python -m deploy ...``)
    argv = [sys.executable, *[a for a in sys.orig_argv[1:] if a != "--detach"]]
    with log.open("ab") as out:
        offset = out.tell()
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    deadline = time.monotonic() + (ready_s if ready_s is not None else 180.0)
    while True:
        text = log.read_bytes()[offset:].decode("utf-8", errors="replace")
        if READY_LAST_LINE in text or (ready_s is None and STANDBY_LINE in text):
            print(text.rstrip(), flush=True)
            print(f"running in the background (pid {child.pid}); log: {log}; stop: quorum aggregator stop",
                  flush=True)
            return
        if child.poll() is not None or time.monotonic() > deadline:
            if child.poll() is None:
                child.terminate()
            _fail(f"the aggregator did not start (see {log}):\n{text.strip()[-1500:]}")
        time.sleep(0.3)


def _announce(sup: Supervisor) -> None:
    from deploy.pki import fingerprint

    cfg = sup.config
    print(f"aggregator ready: devices connect to {cfg.device_address}", flush=True)
    if sup.tls is not None:
        print(f"CA certificate:   {sup.tls.ca_cert}", flush=True)
        print(f"CA fingerprint:   SHA256 {fingerprint(sup.tls.ca_cert.read_bytes())}", flush=True)
    else:
        print("TLS:              OFF (--insecure, loopback only)", flush=True)
    if cfg.dashboard.enabled:
        print(f"dashboard:        http://{cfg.dashboard.host}:{cfg.dashboard.port}/", flush=True)
    print(f"run store:        {cfg.db_url}", flush=True)
    if sup.edge is not None:
        print(f"edge of:          {sup.edge.upstream}, as {sup.edge.name} (log {cfg.state.logs / 'upstream.log'})",
              flush=True)
    print(f"{READY_LAST_LINE}  quorum client enroll NAME; submit a run: quorum aggregator run SCENARIO",
          flush=True)


@app.command()
def run(
    scenario: Annotated[Path | None, typer.Argument(help="Scenario TOML file.")] = None,
    config: ConfigOption = None,
    resume: Annotated[str | None, typer.Option(help="Continue this stored run from its last round.")] = None,
    rounds: Annotated[int | None, typer.Option(help="Override the scenario's rounds.")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the scenario's seed.")] = None,
    wait: Annotated[bool, typer.Option(help="Wait until the run ends, printing rounds as they commit.")] = False,
    timeout: Annotated[float, typer.Option(help="With --wait: give up after this many seconds.")] = 3600.0,
) -> None:
    """Submit a federated run to the running aggregator (the same round loop as in simulation).

    First it checks that the scenario's federation.min_clients devices are online; if not, it waits with a
    count up to aggregator.wait_clients_s, then refuses with the numbers. With --wait it exits 0 when the run
    finishes (or its privacy budget stops it), 3 with the reasons when it degrades (a client failed or was
    rejected, or never contributed), 1 with the reason when it fails or never starts.
    """
    from deploy.readiness import await_devices
    from deploy.submit import submit, submitted_scenario

    cfg = _load(config)
    overrides = {k: v for k, v in (("rounds", rounds), ("seed", seed)) if v is not None}
    try:
        spec = submitted_scenario(cfg, scenario, resume)
        if spec.hierarchy.enabled:
            from aggregator.hierarchy.fleet import deployed_tree_problem

            problem = deployed_tree_problem(spec)
            if problem is not None:
                _fail(problem)
        await_devices(cfg, spec, say=lambda m: console.print(m))
        flower_run = submit(cfg, scenario, resume, overrides)
    except (QuorumError, ScenarioError) as exc:
        _fail(str(exc))
    print(f"submitted: Flower run {flower_run}", flush=True)
    if wait:
        _follow(cfg, flower_run, timeout, spec)


def _follow(cfg: DeployConfig, flower_run: int, timeout_s: float, scenario: Scenario | None = None) -> None:
    """Print each round as it commits, then exit with the run's code.

    The code is 0 finished, 3 degraded, 1 failed or interrupted
    (``core.outcomes.exit_code``). Until the run opens, say how many devices
    are connected.
    """
    from core.outcomes import exit_code
    from deploy.status import ServerAppWatch, find_stored_run
    from runstore.store import RunStore

    store, deadline, shown = RunStore(cfg.db_url), time.monotonic() + timeout_s, 0
    watch = ServerAppWatch(cfg, flower_run)
    waiting = DeviceWait(cfg, scenario) if scenario is not None else None
    run_id: str | None = None  # once opened, followed by its own id: a resume gives it another Flower run
    said_interrupted = False
    while time.monotonic() < deadline:
        run = find_stored_run(store, flower_run) if run_id is None else store.get_run(run_id)
        if run is None:  # not opened yet: still waiting for devices, or its ServerApp died without a word
            why = watch.dead()
            if why is not None:
                print(f"Flower run {flower_run} failed: {why}", flush=True)
                raise typer.Exit(1)
            if waiting is not None:
                waiting.poll()
        else:
            if run_id is None and run.status == RunStatus.RUNNING:
                print(f"run {run.id} started: {run.rounds_total} rounds", flush=True)
            run_id = run.id
            for r in store.rounds(run.id)[shown:]:
                print(f"run {run.id} round {r.round}: {_round_line(store, run, r)}", flush=True)
                shown = r.round
            stopped = run.status == RunStatus.FAILED and (run.error or "").startswith(("SystemExit",
                                                                                          "KeyboardInterrupt"))
            if run.status == RunStatus.INTERRUPTED or stopped:  # a ServerApp stopped under it: resumed soon
                said_interrupted = _interrupted(cfg, run, said_interrupted)
            elif run.status != RunStatus.RUNNING:
                print(f"run {run.id} {run.status}" + (f": {run.error}" if run.error else ""), flush=True)
                raise typer.Exit(exit_code(run.status))
            else:
                said_interrupted = False
        time.sleep(0.5)
    _fail(f"run did not end within {timeout_s:g} s")


def _interrupted(cfg: DeployConfig, run: Run, said: bool) -> bool:
    """Say why ``run`` stopped and what happens next; wait on while this host's aggregator resumes it.

    Returns whether that was said (it is said once per interruption); exits 1
    when nothing here will resume the run, naming the command that does.
    """
    from core.outcomes import exit_code
    from deploy.status import aggregator_resumes

    why = f" ({run.error})" if run.error else ""
    if aggregator_resumes(cfg):
        if not said:
            print(f"run {run.id} interrupted after round {run.rounds_done}{why}; the aggregator resumes it from "
                  "its last committed round: waiting", flush=True)
        return True
    print(f"run {run.id} interrupted after round {run.rounds_done}{why}; no aggregator runs here to resume it: "
          f"start it (quorum aggregator start) and it resumes the run, or quorum aggregator run --resume {run.id}",
          flush=True)
    raise typer.Exit(exit_code(RunStatus.INTERRUPTED))


#: While a submitted run has not opened: how often the connected devices are counted again (each count
#: is one Control API call, milliseconds; the count is printed only when it changes).
WAIT_COUNT_S = 2.0


@dataclass
class DeviceWait:
    """Says how many devices are connected out of how many the run waits for, whenever the count changes."""

    config: DeployConfig
    scenario: Scenario
    said: int = -1
    next_at: float = 0.0

    def poll(self, now: float | None = None) -> None:
        from deploy.readiness import fleet

        now = time.monotonic() if now is None else now
        if now < self.next_at:
            return
        self.next_at = now + WAIT_COUNT_S
        try:
            online = fleet(self.config).online
        except QuorumError:  # the SuperLink busy or restarting: count again next time
            return
        if len(online) != self.said:
            self.said = len(online)
            fed = self.scenario.federation
            print(f"waiting for devices: {len(online)} of {fed.clients} connected ({', '.join(online) or 'none'}); "
                  f"the run starts once {fed.clients} are, or with at least {fed.min_clients} after "
                  f"aggregator.wait_clients_s = {self.config.aggregator.wait_clients_s:g} s", flush=True)


def _round_line(store: RunStore, run: Run, r: Round) -> str:
    """``2/3 answered, 1 failed: device-3 DataError: no label column 'label', 14.0 s, accuracy 0.741``."""
    from core.outcomes import count, edges_line, round_line

    names = {str(k): str(v) for k, v in ((run.info or {}).get("devices") or {}).items()}
    acc = "" if r.server_accuracy is None else f", accuracy {r.server_accuracy:.3f}"
    acc = acc or ("" if r.fed_accuracy is None else f", accuracy {r.fed_accuracy:.3f} (on the devices)")
    clients = round_line(r.sampled, count(store.client_results(run.id, r.round), names)) + edges_line(r.tree)
    return f"{clients}, {r.duration_s:.1f} s{acc}"


@app.command()
def stop(
    config: ConfigOption = None,
    timeout: Annotated[float, typer.Option(min=1, help="Seconds to wait for it to exit.")] = 60.0,
) -> None:
    """Stop the aggregator started from this federation.toml (a running run resumes at the next start)."""
    from deploy.status import stop_aggregator

    cfg = _load(config)
    try:
        pid = stop_aggregator(cfg, timeout)
    except QuorumError as exc:
        _fail(str(exc))
    console.print(f"aggregator (pid {pid}) stopped")


@app.command()
def status(
    config: ConfigOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Show the connected clients and the current run."""
    from deploy.status import collect_status, render_status

    cfg = _load(config)
    try:
        info = collect_status(cfg)
    except QuorumError as exc:
        _fail(str(exc))
    if json_out:
        sys.stdout.write(json.dumps(info) + "\n")
    else:
        render_status(info)
