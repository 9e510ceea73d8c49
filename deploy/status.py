"""``quorum aggregator status``: is it up, who is connected, what is running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.status import RunStatus
from deploy.config import DeployConfig
from deploy.enroll import load_registry, revoked_devices
from deploy.errors import DeployError
from deploy.flower import list_nodes
from runstore.store import Run, RunStore

__all__ = ["aggregator_resumes", "running_aggregator", "collect_status", "render_status", "find_stored_run",
           "serverapp_pids", "ServerAppWatch", "stop_aggregator"]

#: How long a run may go without a ServerApp (Flower starts one in about a second) before it is called dead.
START_GRACE_S = 120.0
#: How long after its ServerApp exits a run may still appear in the store (its last write).
EXIT_GRACE_S = 5.0


def find_stored_run(store: RunStore, flower_run: int) -> Run | None:
    """Return the stored run whose recorded ``flower_run_id`` is ``flower_run``, or None before it opens."""
    for run in store.list_runs():
        if (run.info or {}).get("flower_run_id") == flower_run:
            return run
    return None


def serverapp_pids(config: DeployConfig, flower_run: int) -> list[int]:
    """Return the pids of the live ServerApp processes of ``flower_run`` (each leaves a pid file while it runs)."""
    pids = []
    for path in (config.state.root / "serverapps").glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written or removed
        pid = int(entry.get("pid", 0)) if isinstance(entry.get("pid"), int) else 0
        if entry.get("flower_run") == flower_run and _alive(pid) and "serverapp" in " ".join(_command(pid)):
            pids.append(pid)  # not a zombie (no arguments) or a reused pid (another program)
    return pids


class ServerAppWatch:
    """Tells when a Flower run's ServerApp is gone without having opened a stored run (``--wait``)."""

    def __init__(self, config: DeployConfig, flower_run: int) -> None:
        self.config, self.flower_run = config, flower_run
        self.started, self.seen = time.monotonic(), False
        self.gone_at: float | None = None

    def dead(self) -> str | None:
        """Why the run will never open (naming its log), or ``None`` while it still may."""
        now = time.monotonic()
        log = self.config.state.root / "logs" / f"serverapp-{self.flower_run}.log"
        if serverapp_pids(self.config, self.flower_run):
            self.seen, self.gone_at = True, None
            return None
        self.seen = self.seen or log.exists()  # it started (and left its log) between two looks
        if not self.seen:
            if now - self.started > START_GRACE_S:
                return f"no ServerApp started within {START_GRACE_S:g} s (see {log.parent / 'superlink.log'})"
            return None
        if self.gone_at is None:
            self.gone_at = now
        if now - self.gone_at > EXIT_GRACE_S:
            return f"its ServerApp exited without opening a run: {_last_error(log)} (log: {log})"
        return None


def _last_error(log: Path) -> str:
    """Return the last line of ``log`` that names an error (at most 300 characters), or a plain hint."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [line.strip() for line in lines if "Error" in line or "error" in line]
    return errors[-1][:300] if errors else "no error in its log"


def stop_aggregator(config: DeployConfig, timeout_s: float = 60.0, poll_s: float = 0.2) -> int:
    """SIGTERM the aggregator this config's state folder names, and wait until it is gone; returns its pid.

    It stops its own children (SuperLink, front door, dashboard); a ServerApp that Flower started ends on
    its own soon after, and a run in progress is resumed by the next ``aggregator start``.

    Raises
    ------
    DeployError
        Nothing running here, a pid file naming another program, or no exit within ``timeout_s``.
    """
    path = config.state.pidfile
    try:
        pid = int(json.loads(path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        raise DeployError(f"no aggregator running here ({path} is missing or unreadable)") from None
    if not _alive(pid):
        raise DeployError(f"no aggregator running here (pid {pid} in {path} has exited)")
    words = _command(pid)
    if not any(a == "aggregator" and b == "start" for a, b in zip(words, words[1:], strict=False)):
        raise DeployError(f"pid {pid} in {path} is not `quorum aggregator start` ({' '.join(words)[:80]!r}); "
                          "not stopping it")
    try:
        os.kill(pid, signal.SIGTERM)
    except PermissionError:
        raise DeployError(f"aggregator pid {pid} belongs to another user; stop it as that user") from None
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() >= deadline:
            raise DeployError(f"aggregator pid {pid} did not stop within {timeout_s:g} s; kill -9 {pid} ends it")
        time.sleep(poll_s)
    return pid


def _command(pid: int) -> list[str]:
    """Return a process's arguments (``/proc``, else ``ps``); empty for a zombie or a process that is gone."""
    try:
        return [w.decode(errors="replace") for w in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if w]
    except OSError:
        pass
    try:
        done = subprocess.run(["ps", "-p", str(pid), "-o", "command="], capture_output=True, text=True, timeout=10,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    return done.stdout.split()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, not yet reaped by its parent) does not."""
    if pid <= 0:  # 0 and -1 would signal whole process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: the signal check is all there is


def aggregator_resumes(config: DeployConfig) -> bool:
    """Whether this host's aggregator is up and resumes interrupted runs by itself (not ``--no-resume``)."""
    try:
        up = json.loads(config.state.pidfile.read_text())
        return _alive(int(up["pid"])) and bool(up.get("resume", True))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _current_run(config: DeployConfig) -> dict[str, Any] | None:
    with RunStore(config.db_url) as store:
        runs = [r for r in store.list_runs() if r.engine == "deployment"]
    if not runs:
        return None
    run = next((r for r in runs if r.status == RunStatus.RUNNING), runs[0])
    return {"id": run.id, "name": run.name, "status": run.status, "rounds_done": run.rounds_done,
            "rounds_total": run.rounds_total, "error": run.error}


def running_aggregator(config: DeployConfig) -> int | None:
    """Return the pid of the ``quorum aggregator start`` this state folder's pid file names, while it runs."""
    try:
        pid = int(json.loads(config.state.pidfile.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    words = _command(pid) if _alive(pid) else []
    return pid if any(a == "aggregator" and b == "start" for a, b in zip(words, words[1:], strict=False)) else None


def collect_status(config: DeployConfig) -> dict[str, Any]:
    """Everything ``status`` shows, as one JSON-able dict."""
    path = config.state.pidfile
    up = json.loads(path.read_text()) if path.exists() else None
    if up is not None and not _alive(int(up["pid"])):
        up = None
    names = {d.node_id: d.name for d in load_registry(config).values()}
    revoked = revoked_devices(config)  # the SuperLink keeps their nodes, as "unregistered"
    nodes: list[dict[str, Any]] = []
    if up is not None:
        try:
            nodes = [_node(int(n["node-id"]), str(n.get("status", "")), names, revoked) for n in list_nodes(config)]
        except DeployError as exc:
            up["error"] = str(exc)
    enrolled_ids = {n["node_id"] for n in nodes}
    nodes += [{"node_id": i, "name": n, "status": "unknown"} for i, n in names.items() if i not in enrolled_ids]
    return {"running": up is not None, "aggregator": up, "clients": nodes,
            "connected": sum(1 for n in nodes if n["status"] == "online"), "run": _current_run(config)}


def _node(node_id: int, status: str, names: dict[int, str], revoked: dict[int, str]) -> dict[str, Any]:
    """One node as ``status`` lists it: a device revoked here is ``revoked``, under its name."""
    if node_id not in names and node_id in revoked:
        return {"node_id": node_id, "name": revoked[node_id], "status": "revoked"}
    return {"node_id": node_id, "name": names.get(node_id, ""), "status": status}


def render_status(info: dict[str, Any]) -> None:
    """Print :func:`collect_status`'s dict for a terminal: the aggregator, a table of clients, the current run."""
    out = Console(markup=False, highlight=False)  # names, addresses and errors as they are
    up = info["aggregator"]
    if up is None:
        out.print(Text("aggregator not running", "bold red"))
    else:
        out.print(Text.assemble(("aggregator running", "bold green"), f" (pid {up['pid']}): devices connect to ",
                                (str(up["device_address"]), "bold")))
        if up.get("ca_fingerprint"):
            out.print(f"CA fingerprint SHA256 {up['ca_fingerprint']}")
    table = Table(title=f"clients ({info['connected']} connected)")
    for col in ("name", "node id", "status"):
        table.add_column(col)
    for n in sorted(info["clients"], key=lambda n: (n["status"] != "online", n["name"])):
        table.add_row(n["name"] or "(not enrolled here)", str(n["node_id"]), n["status"])
    out.print(table)
    run = info["run"]
    if run is None:
        out.print("no run yet")
    else:
        out.print(Text.assemble("run ", (str(run["id"]), "bold"), f" ({run['name']}): {run['status']}, "
                                f"round {run['rounds_done']}/{run['rounds_total']}"
                                + (f" - {run['error']}" if run["error"] else "")))
