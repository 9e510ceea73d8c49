"""``quorum aggregator status``: is it up, who is connected, what is running."""

from __future__ import annotations

import json
import os
from typing import Any

from rich.console import Console
from rich.table import Table

from aggregator.store import Run, RunStore
from deploy.config import DeployConfig
from deploy.enroll import load_registry
from deploy.errors import DeployError
from deploy.flower import list_nodes

__all__ = ["collect_status", "render_status", "find_stored_run"]


def find_stored_run(store: RunStore, flower_run: int) -> Run | None:
    for run in store.list_runs():
        if (run.info or {}).get("flower_run_id") == flower_run:
            return run
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _current_run(config: DeployConfig) -> dict[str, Any] | None:
    runs = [r for r in RunStore(config.db_url).list_runs() if r.engine == "deployment"]
    if not runs:
        return None
    run = next((r for r in runs if r.status == "running"), runs[0])
    return {"id": run.id, "name": run.name, "status": run.status, "rounds_done": run.rounds_done,
            "rounds_total": run.rounds_total, "error": run.error}


def collect_status(config: DeployConfig) -> dict[str, Any]:
    """Everything ``status`` shows, as one JSON-able dict."""
    path = config.state.pidfile
    up = json.loads(path.read_text()) if path.exists() else None
    if up is not None and not _alive(int(up["pid"])):
        up = None
    names = {d.node_id: d.name for d in load_registry(config).values()}
    nodes: list[dict[str, Any]] = []
    if up is not None:
        try:
            nodes = [{"node_id": int(n["node-id"]), "name": names.get(int(n["node-id"]), ""),
                      "status": n.get("status", "")} for n in list_nodes(config)]
        except DeployError as exc:
            up["error"] = str(exc)
    enrolled_ids = {n["node_id"] for n in nodes}
    nodes += [{"node_id": i, "name": n, "status": "unknown"} for i, n in names.items() if i not in enrolled_ids]
    return {"running": up is not None, "aggregator": up, "clients": nodes,
            "connected": sum(1 for n in nodes if n["status"] == "online"), "run": _current_run(config)}


def render_status(info: dict[str, Any]) -> None:
    out = Console(highlight=False)
    up = info["aggregator"]
    if up is None:
        out.print("[bold red]aggregator not running[/]")
    else:
        out.print(f"[bold green]aggregator running[/] (pid {up['pid']}): devices connect to "
                  f"[bold]{up['device_address']}[/]")
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
        out.print(f"run [bold]{run['id']}[/] ({run['name']}): {run['status']}, "
                  f"round {run['rounds_done']}/{run['rounds_total']}" + (f" - {run['error']}" if run["error"] else ""))
