"""A whole federation on one machine, over loopback: for trying, testing, benchmarking.

Every process is started in a session of its own and carries an environment
tag (``QUORUM_LOOPBACK_TAG``) that its descendants inherit, Flower's detached
SuperExec and ServerApp processes included; :meth:`Processes.stop_all` ends
them by PID, never by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deploy.config import load_config
from deploy.enroll import directory_path
from deploy.errors import ProcessFailed
from learning.federation import build_federation
from scenarios.schema import load_scenario

__all__ = ["Processes", "Started", "free_ports", "write_device_data", "LoopbackFederation", "TAG_ENV"]

TAG_ENV = "QUORUM_LOOPBACK_TAG"
_CLI = [sys.executable, "-m", "deploy"]


def free_ports(count: int) -> list[int]:
    """Return ``count`` distinct TCP ports on 127.0.0.1 the kernel found free (released again on return)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _tagged(tag: str) -> list[int]:
    needle, found = f"{TAG_ENV}={tag}\0".encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes() and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
    return found


@dataclass
class Started:
    """A started process: its name, its ``Popen`` and the log file its stdout and stderr go to."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        """Return the log so far ("" before the file exists)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (a crash: no clean-up runs), and reap the leader."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)
        self.popen.wait(timeout=30)


@dataclass
class Processes:
    """The processes one federation started; :meth:`stop_all` ends them and their descendants."""

    workdir: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: list[Started] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> Started:
        """Start ``argv`` in a new session, tagged, logging to ``workdir/<name>.log``; return it.

        The process inherits this environment plus ``env``, the federation's
        tag and this repository on ``PYTHONPATH``; it runs in ``cwd`` (default
        ``workdir``) with stdin closed.
        """
        full = {**os.environ, **(env or {}), TAG_ENV: self.tag}
        root = str(Path(__file__).resolve().parents[2])
        full["PYTHONPATH"] = os.pathsep.join(p for p in (root, full.get("PYTHONPATH", "")) if p)
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=full, cwd=cwd or self.workdir, start_new_session=True)
        started = Started(name, popen, log)
        self.started.append(started)
        return started

    def alive(self) -> list[int]:
        """Return the pids of the live (not zombie) processes that carry this federation's tag."""
        return _tagged(self.tag)

    def wait_gone(self, pids: Sequence[int], timeout_s: float = 30.0) -> list[int]:
        """Wait up to ``timeout_s`` for ``pids`` to exit, reaping started ones; return those still alive."""
        deadline = time.monotonic() + timeout_s
        left = [p for p in pids if p in self.alive()]
        while left and time.monotonic() < deadline:
            for s in self.started:
                s.popen.poll()
            time.sleep(0.1)
            left = [p for p in left if p in self.alive()]
        return left

    def stop_all(self, grace_s: float = 15.0) -> list[int]:
        """SIGTERM what was started and every tagged descendant, SIGKILL stragglers; returns those."""
        for s in reversed(self.started):
            if s.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(s.popen.pid, signal.SIGTERM)
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        stubborn = self.wait_gone(self.alive(), grace_s)
        for pid in stubborn:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for s in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.popen.wait(timeout=5)
        self.wait_gone(self.alive(), 5.0)
        return stubborn


def write_device_data(scenario_path: Path, out_dir: Path) -> list[Path]:
    """Each simulated device's share of the scenario's data set, as its own ``.npz`` file."""
    spec = load_scenario(scenario_path)
    fed = build_federation(spec.data, spec.federation.clients, spec.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, client in enumerate(fed.clients):
        path = out_dir / f"device-{i}.npz"
        np.savez(path, x=np.concatenate([client.train.x, client.test.x]),
                 y=np.concatenate([client.train.y, client.test.y]))
        paths.append(path)
    return paths


def _wait_for(started: Started, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in started.text():
            return
        if started.popen.poll() is not None:
            raise ProcessFailed(f"{started.name} exited (rc {started.popen.returncode}):\n{started.text()[-3000:]}")
        time.sleep(0.1)
    raise ProcessFailed(f"{started.name} did not print {text!r} within {timeout_s:g} s:\n{started.text()[-3000:]}")


@dataclass
class LoopbackFederation:
    """An aggregator and its devices on 127.0.0.1, driven through the real commands."""

    workdir: Path
    procs: Processes
    port: int = 0
    internal_port: int = 0
    dashboard_port: int = 0
    insecure: bool = False
    poll_s: float = 0.2
    database: str = ""  # the run store's URL (PostgreSQL for a standby); "" for SQLite in the state folder
    name: str = "loopback"  # aggregator.name (an edge's: the name it was enrolled under at its aggregator)
    dashboard: bool = True  # whether the aggregator serves its dashboard
    aggregator: Started | None = None
    agents: dict[str, Started] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Pick free ports unless given, write ``workdir/federation.toml`` and load it as ``deploy``."""
        if not self.port:
            self.port, self.internal_port, self.dashboard_port = free_ports(3)
        self.config = self._write_config("federation.toml", "state", self.internal_port)
        self.deploy = load_config(self.config)

    def _write_config(self, file: str, state_dir: str, internal_port: int) -> Path:
        path = self.workdir / file
        database = f'database = "{self.database}"\n' if self.database else ""
        path.write_text(
            f'[aggregator]\nname = "{self.name}"\naddress = "127.0.0.1"\nlisten = "127.0.0.1"\nport = {self.port}\n'
            f'internal_port = {internal_port}\nstate_dir = "{state_dir}"\ninsecure = {str(self.insecure).lower()}\n'
            f'wait_clients_s = 60.0\n{database}\n[dashboard]\nport = {self.dashboard_port}\n'
            f'enabled = {str(self.dashboard).lower()}\n')
        return path

    def second_host(self, state_dir: str = "state-b") -> Path:
        """Write the config of a second aggregator of this federation; return its path.

        The same name, front door and dashboard port and run store (a standby
        takes them over), its own state folder with a copy of this one's TLS
        files (as docs/deploy.md has them copied to the second host), and its
        own SuperLink port: a ServerApp the dead leader left behind must not
        reach the new SuperLink.
        """
        import shutil

        second = self._write_config(f"{state_dir}.toml", state_dir, free_ports(1)[0])
        tls = self.deploy.state.tls
        if tls.exists():
            target = load_config(second).state.tls
            shutil.copytree(tls, target, dirs_exist_ok=True)
        return second

    @property
    def address(self) -> str:
        """Return the address devices dial: ``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run ``python -m deploy *args`` in ``workdir``, tagged; return it completed, output captured."""
        env = {**os.environ, TAG_ENV: self.procs.tag}
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        return subprocess.run([*_CLI, *args], capture_output=True, text=True, env=env, timeout=timeout_s,
                              cwd=self.workdir, stdin=subprocess.DEVNULL, check=False)

    def start_aggregator(self, timeout_s: float = 90.0, config: Path | None = None, standby: bool = False,
                         extra: Sequence[str] = ()) -> Started:
        """Start ``aggregator start`` (on ``config``, default this federation's) and wait until it is up.

        Up: it logs ``aggregator ready``, or with ``standby`` (``--standby``)
        that it waits for the lead (or took it). The last started is
        :attr:`aggregator`. ``extra``: more options (an edge's ``--edge --upstream ...``).

        Raises
        ------
        ProcessFailed
            The aggregator exited or was not up within ``timeout_s``.
        """
        n = sum(1 for s in self.procs.started if s.name.startswith("aggregator"))
        argv = [*_CLI, "aggregator", "start", "-c", str(config or self.config), *(["--standby"] if standby else []),
                *extra]
        self.aggregator = self.procs.start(f"aggregator-{n}", argv)
        _wait_for(self.aggregator, "standby:" if standby else "aggregator ready", timeout_s)
        return self.aggregator

    def enroll(self, name: str) -> None:
        """Enroll device ``name`` with ``client enroll``.

        Raises
        ------
        ProcessFailed
            The command exited non-zero.
        """
        done = self.cli("client", "enroll", name, "-c", str(self.config))
        if done.returncode != 0:
            raise ProcessFailed(f"enroll {name} failed:\n{done.stdout}\n{done.stderr}")

    def key(self, name: str) -> Path:
        """Return the path of device ``name``'s key, as enrolment writes it."""
        return self.deploy.state.keys / f"{name}.key"

    def start_agent(self, name: str, data: Path, key: Path | None = None, runtime_port: int | None = None,
                    connect_timeout_s: float = 90.0, wait: bool = True, policy: Path | None = None) -> Started:
        """Start ``client start`` for device ``name`` on ``data``; return the agent process.

        It uses the device's key and the federation's CA (or ``--insecure``),
        its secure-aggregation identity when enrolment issued one, and the
        site policy ``policy`` when given (``--policy``). With ``wait``, block
        until its SuperNode logs its node id.

        Raises
        ------
        ProcessFailed
            With ``wait``: the agent exited, or its SuperNode logged no node id within ``connect_timeout_s``.
        """
        port = runtime_port or free_ports(1)[0]
        argv = [*_CLI, "client", "start", "--server", self.address, "--data", str(data), "--name", name,
                "--runtime-port", str(port), "--poll", str(self.poll_s), "--workdir", str(self.workdir / name)]
        argv += ["--insecure"] if self.insecure else ["--key", str(key or self.key(name)),
                                                       "--ca", str(self.deploy.state.tls / "ca.pem")]
        identity = self.deploy.state.keys / f"{name}.secagg.key"  # issued by `quorum client enroll`
        if identity.exists():
            argv += ["--secagg-identity", str(identity), "--secagg-directory", str(directory_path(self.deploy))]
        if policy is not None:
            argv += ["--policy", str(policy)]
        agent = self.procs.start(f"agent-{name}", argv)
        self.agents[name] = agent
        if wait:
            _wait_for(Started(name, agent.popen, self.workdir / name / "logs" / "supernode.log"),
                      "SuperNode ID:", connect_timeout_s)
        return agent

    def supernode_log(self, name: str) -> Path:
        """Return the path of device ``name``'s SuperNode log."""
        return self.workdir / name / "logs" / "supernode.log"
