"""``quorum aggregator start``: the SuperLink, its front door, the dashboard; kept running.

Process layout on the aggregator host (all children of this process, in its
process group, so a crash of the host's supervisor takes them along; the
ServerApp of a run lives under the SuperLink's SuperExec and exits within a
second of the SuperLink)::

    quorum aggregator start            this process: starts, watches, restarts, stops
      flower-superlink 127.0.0.1:INTERNAL   TLS, node auth, database in the state folder
      nginx  LISTEN:PORT                 TLS; passes /v1/fleet/<rpc> and /health only
      python -m dashboard 127.0.0.1:8000 read-only, over the run store

A SuperLink or nginx that exits is restarted (devices reconnect by
themselves). On start, runs that a crash interrupted are submitted again
with ``resume`` and continue from their last committed round.

On a PostgreSQL run store the aggregator leads only while it holds the
federation's advisory lock (``runstore/leader.py``): a second one started with
``standby`` waits for it, and once the leader dies (its connection closes)
takes the lock, restores the enrolled devices from the store
(``deploy/failover.py``), starts its own processes on the same addresses and
resumes the interrupted runs, each with a ``failover`` event. A leader whose
lock connection is lost stops its processes and exits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.exc import SQLAlchemyError

from core.errors import StoreError
from core.status import RunStatus
from deploy.config import DeployConfig
from deploy.edge import EdgeBridge, EdgeSpec, upstream_agent_argv
from deploy.enroll import load_registry, publish_devices, write_atomically
from deploy.errors import DeployError, ProcessFailed
from deploy.failover import restore_devices
from deploy.flower import (
    flower_env,
    stop_run,
    stop_unfinished_runs,
    submit_run,
    superlink_command,
    warm_up,
    write_flower_home,
)
from deploy.pki import TlsFiles, ensure_tls, fingerprint
from deploy.ports import describe_holders, wait_port_free
from deploy.proxy import ProxySpec, nginx_command
from deploy.status import running_aggregator
from deploy.submissions import process_pending
from deploy.submit import submit
from runstore.leader import Leadership, supports_leadership
from runstore.store import RunStore

#: How long a restarted child waits for its port to be let go by what its predecessor left, before naming the holder.
PORT_WAIT_S = 5.0
STABLE_S = 60.0   # a child up this long before it exited restarts at once again (its crash loop is over)
ANSWER_S = 60.0   # a restarted SuperLink silent this long is reported (its runs wait for it still)
SUBMISSIONS_S = 1.0  # how often the leading aggregator looks for the dashboard's queued submissions

__all__ = ["Supervisor", "prepare", "health_url", "wait_healthy", "resumable_runs", "stop_leftover_serverapps"]

Say = Callable[[str], None]


def prepare(config: DeployConfig) -> TlsFiles | None:
    """State folder, certificates (unless insecure) and Flower's config: everything before processes."""
    root = config.state.root
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o711)  # nginx workers (nobody) must traverse to their temp dir; files stay private
    for sub in (config.state.logs, config.state.keys, config.state.proxy):
        sub.mkdir(parents=True, exist_ok=True)
    tls = None if config.aggregator.insecure else ensure_tls(config.state.tls, config.cert_hosts,
                                                             config.aggregator.name)
    write_flower_home(config, tls)
    return tls


def health_url(host: str, port: int, tls: bool) -> str:
    """Return the ``/health`` URL of ``host:port`` (``https`` with TLS, else ``http``)."""
    return f"{'https' if tls else 'http'}://{host}:{port}/health"


def _get(url: str, ca: Path | None, timeout_s: float = 2.0) -> int:
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ssl.SSLError):
        return 0


def wait_healthy(url: str, ca: Path | None, proc: subprocess.Popen[bytes] | None, timeout_s: float,
                 what: str, log: Path | None = None) -> None:
    """Poll ``url`` until it answers 200, verified by ``ca`` when given.

    Raises
    ------
    ProcessFailed
        ``proc`` exited first (with the tail of ``log``), or ``url`` did not answer 200 within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
            raise ProcessFailed(f"{what} exited with rc {proc.returncode}\n{tail}")
        if _get(url, ca) == 200:
            return
        time.sleep(0.2)
    raise ProcessFailed(f"{what} did not answer {url} within {timeout_s:g} s")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def stop_leftover_serverapps(state_root: Path, grace_s: float = 10.0) -> list[int]:
    """End ServerApps a crashed aggregator left behind (they write ``serverapps/<pid>.json``).

    A killed SuperLink's ServerApp notices only after its current retry back-off
    (up to 20 s); it must not talk to the new SuperLink. The pid is checked against
    the process's command line, so a reused pid is never signalled.
    """
    folder = state_root / "serverapps"
    found = []
    for entry in sorted(folder.glob("*.json")) if folder.exists() else []:
        pid = int(json.loads(entry.read_text())["pid"])
        if b"flwr-serverapp" in _cmdline(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
                found.append(pid)
        entry.unlink(missing_ok=True)
    deadline = time.monotonic() + grace_s
    while any(b"flwr-serverapp" in _cmdline(p) for p in found) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in found:
        if b"flwr-serverapp" in _cmdline(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return found


def resumable_runs(db_url: str, federation: str | None = None) -> list[str]:
    """Deployment runs a crash interrupted: unfinished, and not failed by an error of their own.

    With ``federation``, only that federation's runs (its ``aggregator.name``, which
    ``quorum aggregator run`` records in the run's info) and runs from before
    that record: two federations may share one PostgreSQL database, and a
    standby of one must never resume the other's runs.
    """
    with RunStore(db_url) as store:
        runs = store.list_runs()
    found = []
    for run in runs:
        if run.engine != "deployment" or run.rounds_done >= run.rounds_total:
            continue
        if federation is not None and (run.info or {}).get("federation", federation) != federation:
            continue
        crashed = run.status == RunStatus.FAILED and (run.error or "").startswith(("SystemExit", "KeyboardInterrupt"))
        if run.status in (RunStatus.RUNNING, RunStatus.INTERRUPTED) or crashed:
            found.append(run.id)
    return found


@dataclass
class _Child:
    """One process the supervisor keeps running, in a process group of its own with what it starts.

    ``port`` is the ``(host, port)`` it listens on, checked free before a restart; ``death_signal`` what it
    gets when the supervisor dies (:func:`_die_with_parent`).
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    port: tuple[str, int] | None = None
    death_signal: signal.Signals = signal.SIGKILL
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0   # time.monotonic() of the last start

    def start(self) -> None:
        """Start it, in a new process group (its workers and ServerApps join that group)."""
        self.started_at = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, process_group=0,
                                         preexec_fn=functools.partial(_die_with_parent, self.death_signal))

    def signal_group(self, sig: signal.Signals) -> None:
        """Send ``sig`` to its whole process group: an nginx master's workers.

        A SuperLink's ServerApps run in sessions of their own (:func:`stop_leftover_serverapps`).
        """
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float) -> None:
        """SIGTERM its group, SIGKILL what is left of it after ``grace_s``."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.signal_group(signal.SIGKILL)  # what the leader left: an orphaned worker, a ServerApp


def _die_with_parent(sig: signal.Signals) -> None:
    """In a child before exec: have it sent ``sig`` when the supervisor dies, even by SIGKILL.

    So no SuperLink or front door outlives the lead it was started under (Linux's ``PR_SET_PDEATHSIG``).
    SIGKILL frees a SuperLink's ports at once, as the death of its host would (a SIGTERMed one
    held them for seconds while a standby waited); nginx's master gets SIGTERM, so it takes its
    workers, which SIGKILL would orphan on the front door's port.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG


@dataclass
class Supervisor:
    """Starts and watches the aggregator's processes (see the module docstring)."""

    config: DeployConfig
    say: Say = print
    resume: bool = True
    standby: bool = False
    children: dict[str, _Child] = field(default_factory=dict)
    tls: TlsFiles | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    leadership: Leadership | None = None
    took_over: bool = False     # this aggregator waited as a standby, then took the lead
    lost_lead: str | None = None  # why it stopped leading, when it did
    resume_pending: float | None = None  # since when a restarted SuperLink's runs wait for it to answer
    resume_late_said: bool = False       # ... and that it is late was said
    submissions_store: RunStore | None = None  # the run store the watch loop reads queued submissions from
    edge: EdgeSpec | None = None  # an edge aggregator's (``--edge``): how it reaches its aggregator
    bridge: EdgeBridge | None = None  # ... and what starts its ServerApps for the aggregator's runs

    # -- start ------------------------------------------------------------
    def start(self) -> bool:
        """Start the SuperLink, the nginx front door and the dashboard, and write the pid file.

        On a PostgreSQL store the federation's lock comes first: taken at once,
        or (``standby``) waited for; False when :meth:`stop` came first. The
        ports must be free (the processes of an aggregator that died are given a few
        seconds); ServerApps a previous aggregator left are stopped, and with
        ``resume`` the runs they left running are marked ``interrupted``
        (:meth:`resume_interrupted` submits them again).

        Raises
        ------
        DeployError
            A port is in use, another aggregator leads, or ``standby`` without a PostgreSQL store.
        ProcessFailed
            The SuperLink or nginx exited or did not answer its health check in time.
        """
        cfg, a = self.config, self.config.aggregator
        if a.insecure:
            self.say("WARNING: --insecure: TLS and device authentication are OFF. Anyone who can reach "
                     f"{cfg.device_address} can join and read models. Loopback only, for trying things out.")
        if not self._lead():
            return False
        for host, port, what in ((a.listen, a.port, "aggregator.port"),
                                 ("127.0.0.1", a.internal_port, "aggregator.internal_port")):
            if not wait_port_free(host, port, 15.0):
                raise DeployError(f"{what} = {port}: {host}:{port} is in use, {describe_holders(port)} "
                                  "(another aggregator?)")
        self.tls = prepare(cfg)
        stopped = stop_leftover_serverapps(cfg.state.root)
        if stopped:
            self.say(f"stopped {len(stopped)} ServerApp process(es) left by the previous aggregator: {stopped}")
        if self.resume:  # a ServerApp stopped just now wrote "failed: SystemExit": the run awaits its resume
            with RunStore(cfg.db_url) as store:
                for run_id in resumable_runs(cfg.db_url, cfg.aggregator.name):
                    if self.took_over:
                        done = store.get_run(run_id).rounds_done
                        store.log(run_id, f"failover: {self.leadership.who if self.leadership else 'this host'} "
                                          f"took over after round {done} (the leading aggregator stopped)",
                                  "warning")
                    store.set_status(run_id, RunStatus.INTERRUPTED, "the aggregator stopped; resuming")
        logs = cfg.state.logs
        self._spawn("superlink", superlink_command(cfg, self.tls), flower_env(cfg), logs / "superlink.log",
                    ("127.0.0.1", a.internal_port))
        ca = self.tls.ca_cert if self.tls else None
        wait_healthy(health_url("localhost", a.internal_port, self.tls is not None), ca,
                     self.children["superlink"].proc, 60.0, "the SuperLink", logs / "superlink.log")
        self._sync_devices()  # before the front door: no device reaches the SuperLink without its node
        self._stop_orphaned_runs()  # ... nor pulls a message of a run whose ServerApp died
        self._start_front(ca)
        self._start_dashboard()
        self._start_upstream()
        self._write_pidfile()
        return True

    def _start_upstream(self) -> None:
        """On an edge: start its agent towards the aggregator, and the bridge that serves the aggregator's runs."""
        if self.edge is None:
            return
        self.bridge = EdgeBridge(self.config, self.edge, submit_run, self.say)
        # SIGTERM when this supervisor dies: the agent then stops its SuperNode and worker
        self._spawn("upstream", upstream_agent_argv(self.config, self.edge), dict(os.environ),
                    self.config.state.logs / "upstream.log", death_signal=signal.SIGTERM)

    def _lead(self) -> bool:
        """Take the federation's lock (PostgreSQL stores); with ``standby``, wait for it."""
        cfg = self.config
        if not supports_leadership(cfg.db_url):
            if self.standby:
                raise DeployError("--standby needs a PostgreSQL run store that both aggregators share "
                                  "(aggregator.database = \"postgresql+psycopg://USER@HOST/DB\"); this one is "
                                  f"{cfg.db_url.split(':', 1)[0]} ({cfg.db_url})")
            return True
        self.leadership = Leadership(cfg.db_url, cfg.aggregator.name)
        try:
            if self.leadership.try_acquire():
                return True
            if not self.standby:
                raise DeployError(f"another aggregator leads federation {cfg.aggregator.name!r}: "
                                  f"{self.leadership.holder() or 'unknown'}. Start this one with --standby to "
                                  "take over when it stops")
        except StoreError as exc:
            raise DeployError(str(exc)) from None
        self._clear_for_standby()
        if not self.leadership.wait(self.stopping, say=self.say):
            return False
        self.took_over = True
        self.say(f"standby: took the lead of federation {cfg.aggregator.name!r}; starting")
        return True

    def _clear_for_standby(self) -> None:
        """Before a standby waits: what taking the lead would otherwise do on the clock.

        A ServerApp this host left when it last led (killed, its ServerApps in sessions
        of their own) is stopped now, not after the leader dies: one waiting for its
        dead SuperLink takes up to 10 s to end on SIGTERM, and that was the front
        door's worst delay. Skipped while this state folder's own aggregator runs (a
        standby started by mistake on the leader's folder must not stop its ServerApps).
        The Control API client and the app builder are imported now, not at the resume.
        """
        cfg = self.config
        if running_aggregator(cfg) in (None, os.getpid()):
            stopped = stop_leftover_serverapps(cfg.state.root)
            if stopped:
                self.say(f"standby: stopped {len(stopped)} ServerApp process(es) this host left when it led: "
                         f"{stopped}")
        warm_up()

    def _sync_devices(self) -> None:
        """Restore the store's enrolled devices into this host's files and SuperLink, or publish this host's."""
        cfg = self.config
        with RunStore(cfg.db_url) as store:
            devices, nodes = restore_devices(cfg, store, self.say)
        if devices:
            if nodes:
                self.say(f"restored {devices} enrolled device(s) from the run store ({nodes} node(s) "
                         "given back to this SuperLink)")
        elif load_registry(cfg):
            publish_devices(cfg)  # a store from before the devices table: this host's registry fills it

    def _stop_orphaned_runs(self) -> None:
        """Stop the Flower runs this host's link state kept from before (``deploy.flower.stop_unfinished_runs``)."""
        try:
            stopped = stop_unfinished_runs(self.config)
        except DeployError as exc:
            self.say(f"could not stop the SuperLink's earlier runs: {str(exc).splitlines()[0]}")
            return
        if stopped:
            self.say(f"stopped {len(stopped)} Flower run(s) left in this SuperLink's state without a ServerApp: "
                     f"{stopped}")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], log: Path,
               port: tuple[str, int] | None = None, death_signal: signal.Signals = signal.SIGKILL) -> None:
        child = _Child(name, argv, env, log, port, death_signal)
        child.start()
        self.children[name] = child

    def _start_front(self, ca: Path | None) -> None:
        cfg, a, tls = self.config, self.config.aggregator, self.tls
        spec = ProxySpec(listen_host=a.listen, listen_port=a.port, upstream_port=a.internal_port,
                         server_cert=tls.server_cert if tls else None, server_key=tls.server_key if tls else None,
                         ca_cert=ca, workdir=cfg.state.proxy, rate_limit=a.rate_limit)
        self._spawn("proxy", nginx_command(spec), dict(os.environ), cfg.state.logs / "proxy.log", (a.listen, a.port),
                    signal.SIGTERM)  # nginx's master stops its workers on SIGTERM
        host = "localhost" if a.listen in ("0.0.0.0", "::", "127.0.0.1") else a.listen
        wait_healthy(health_url(host, a.port, tls is not None), ca, self.children["proxy"].proc, 30.0, "nginx",
                     cfg.state.proxy / "error.log")

    def _start_dashboard(self) -> None:
        d = self.config.dashboard
        if not d.enabled:
            return
        env = flower_env(self.config, {"QUORUM_DASHBOARD_TOKEN": d.token} if d.token else None)
        argv = [sys.executable, "-m", "dashboard", "--db", self.config.db_url, "--host", d.host,
                "--port", str(d.port)]
        self._spawn("dashboard", argv, env, self.config.state.logs / "dashboard.log", (d.host, d.port))

    def _write_pidfile(self) -> None:
        cfg = self.config
        info = {"pid": os.getpid(), "started_at": time.time(), "resume": self.resume,
                "device_address": cfg.device_address,
                "control_address": cfg.control_address, "db": cfg.db_url,
                "dashboard": f"http://{cfg.dashboard.host}:{cfg.dashboard.port}/" if cfg.dashboard.enabled else None,
                "children": {n: c.proc.pid for n, c in self.children.items() if c.proc},
                "ca_fingerprint": fingerprint(self.tls.ca_cert.read_bytes()) if self.tls else None}
        # atomically: `quorum aggregator status` and tests read it while a restarted child's pid is written
        write_atomically(cfg.state.pidfile, json.dumps(info, indent=2))

    # -- run --------------------------------------------------------------
    def resume_interrupted(self) -> list[str]:
        """Submit every run a crash interrupted again, with ``resume``."""
        resumed = []
        for run_id in resumable_runs(self.config.db_url, self.config.aggregator.name):
            # The restarted SuperLink still counts the crashed Flower run as running: a
            # SuperNode caught mid-download of its message would keep waiting for it (about
            # a minute) instead of taking the resumed run's. Stopping it ends that at once.
            with RunStore(self.config.db_url) as store:
                old = (store.get_run(run_id).info or {}).get("flower_run_id")
            if old is not None:
                with contextlib.suppress(DeployError):
                    stop_run(self.config, int(old))
            try:
                submit(self.config, resume=run_id)
            except DeployError as exc:
                self.say(f"could not resume run {run_id}: {exc}")
                continue
            self.say(f"resuming run {run_id} from its last committed round")
            resumed.append(run_id)
        return resumed

    def watch(self, poll_s: float = 0.5, lead_check_s: float = 2.0) -> None:
        """Restart children that exit, until :meth:`stop`, a signal, or the loss of the lead.

        The lead (its lock's connection) is checked every ``lead_check_s``:
        once lost, :attr:`lost_lead` says why and the watch ends (the caller
        stops the children: the standby leads now).
        """
        checked = polled = time.monotonic()
        while not self.stopping.wait(poll_s):
            if self.leadership is not None and time.monotonic() - checked >= lead_check_s:
                checked = time.monotonic()
                if not self.leadership.alive():
                    self.lost_lead = ("the connection that held the federation's lock in the run store is gone "
                                      "(database restarted or unreachable): another aggregator may lead now")
                    self.say(f"lost the lead: {self.lost_lead}; stopping")
                    return
            for child in self.children.values():
                if child.proc is not None and child.proc.poll() is not None and not self.stopping.is_set():
                    self._restart(child)
            if self.resume_pending is not None and not self.stopping.is_set():
                self._resume_after_superlink()
            if time.monotonic() - polled >= SUBMISSIONS_S and not self.stopping.is_set():
                polled = time.monotonic()
                self._take_submissions()
            if self.bridge is not None and not self.stopping.is_set():
                self.bridge.poll()

    def _take_submissions(self) -> None:
        """Carry out the dashboard's queued submissions (``deploy.submissions``); a store that fails is said."""
        try:
            if self.submissions_store is None:  # one engine for the loop's every-second look, not one per look
                self.submissions_store = RunStore(self.config.db_url)
            process_pending(self.config, self.say, store=self.submissions_store)
        except (StoreError, SQLAlchemyError) as exc:
            self.say(f"could not read the queued submissions: {(str(exc).splitlines() or ['?'])[0]}")

    def _restart(self, child: _Child) -> None:
        """Restart a child that exited: its process group stopped first, its port free or its holder named.

        A crash loop backs off (0, 1, 2, ... 10 s; from 0 again once a start
        lasted :data:`STABLE_S`), in a wait that :meth:`stop` ends. Before a
        SuperLink restarts, its runs' ServerApps are stopped (they run in
        sessions of their own and would carry their round on with the new
        SuperLink, from replies it never had): their runs are resumed from
        their last committed round once it answers (:meth:`_resume_after_superlink`),
        from the watch loop, which goes on checking the lead meanwhile.
        """
        if child.started_at and time.monotonic() - child.started_at >= STABLE_S:
            child.restarts = 0
        child.restarts += 1
        self.say(f"{child.name} exited (rc {child.proc.returncode if child.proc else '?'}); restarting "
                 f"(restart {child.restarts}, log {child.log})")
        child.signal_group(signal.SIGKILL)  # what it left in its group: an nginx master's workers
        if child.port is not None and not wait_port_free(*child.port, PORT_WAIT_S):
            host, port = child.port
            self.say(f"{child.name}: {host}:{port} is still in use, {describe_holders(port)}; "
                     f"{child.name} cannot listen until that process stops")
        if child.name == "superlink":  # its ServerApps (sessions of their own) must not reach the new one
            stopped = stop_leftover_serverapps(self.config.state.root)
            if stopped:
                self.say(f"stopped {len(stopped)} ServerApp process(es) of the SuperLink that exited: {stopped}")
        if self.stopping.wait(min(10.0, child.restarts - 1)):  # the first restart is at once
            return
        child.start()
        self._write_pidfile()
        if child.name == "superlink":
            self.resume_pending, self.resume_late_said = time.monotonic(), False

    def _resume_after_superlink(self) -> None:
        """Resume the runs a restarted SuperLink's lost ServerApps drove, once it answers (with ``resume``).

        Called from the watch loop while :attr:`resume_pending`; nothing is
        resumed by an aggregator that no longer leads (the standby resumes them).
        """
        cfg, since = self.config, self.resume_pending or 0.0
        ca = self.tls.ca_cert if self.tls else None
        if _get(health_url("localhost", cfg.aggregator.internal_port, self.tls is not None), ca, 1.0) != 200:
            if not self.resume_late_said and time.monotonic() - since >= ANSWER_S:
                self.say(f"the restarted SuperLink does not answer after {ANSWER_S:g} s (log "
                         f"{cfg.state.logs / 'superlink.log'}); its runs are resumed once it answers")
                self.resume_late_said = True
            return
        self.resume_pending = None
        if self.leadership is not None and not self.leadership.alive():
            return  # the watch loop's lead check stops this aggregator; the standby resumes the runs
        if not self.resume:
            self.say("the SuperLink restarted; its runs stay interrupted (--no-resume): "
                     "quorum aggregator run --resume RUN continues one")
            return
        stop_leftover_serverapps(cfg.state.root)
        self._stop_orphaned_runs()
        with RunStore(cfg.db_url) as store:
            for run_id in resumable_runs(cfg.db_url, cfg.aggregator.name):
                done = store.get_run(run_id).rounds_done
                store.log(run_id, f"the SuperLink exited and was restarted after round {done}; resuming from it",
                          "warning")
                store.set_status(run_id, RunStatus.INTERRUPTED, "the SuperLink exited; the aggregator resumes it")
        self.resume_interrupted()

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the children (SIGTERM in reverse start order, SIGKILL after ``grace_s``) and remove the pid file."""
        self.stopping.set()
        for child in reversed(list(self.children.values())):
            if child.proc is not None and child.proc.poll() is None:
                child.signal_group(signal.SIGTERM)
        for child in self.children.values():
            child.stop(grace_s)
        with contextlib.suppress(FileNotFoundError):
            self.config.state.pidfile.unlink()
        if self.submissions_store is not None:
            self.submissions_store.close()
        if self.leadership is not None:  # last: a standby starts only once this host's processes are gone
            self.leadership.release()
