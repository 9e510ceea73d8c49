"""``quorum demo``: the dashboard in a background thread, a federation in the foreground."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rich.console import Console
from rich.text import Text

__all__ = ["run_demo"]


def _serve(db: str, host: str, port: int) -> threading.Thread:
    import uvicorn

    from dashboard.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(db), host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name="quorum-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"the dashboard could not listen on {host}:{port} (port in use?)")
    return thread


def run_demo(scenario: Path, *, db: str, host: str, port: int, keep_serving: bool, console: Console) -> None:
    """Serve the dashboard on ``host:port`` and run ``scenario`` into ``db``."""
    from quorum.progress import RoundDisplay
    from runtimes.simulation import simulate
    from scenarios.schema import load_scenario

    spec = load_scenario(scenario)
    thread = _serve(db, host, port)
    console.print(Text.assemble(("dashboard:", "bold"), f" http://{host}:{port}/  (live: open it now)"))
    with RoundDisplay(spec) as display:
        summary = simulate(spec, db_url=db, on_round=display.update, on_start=display.start)
    acc = "n/a" if summary.final_accuracy is None else f"{summary.final_accuracy:.2%}"
    console.print(Text.assemble((summary.status, "bold green"), f": {summary.rounds} rounds, accuracy {acc}, "
                                f"{summary.wall_s:.1f} s; run page: http://{host}:{port}/runs/{summary.run_id}"))
    if keep_serving:
        console.print("dashboard still serving; Ctrl-C to stop")
        try:
            while thread.is_alive():
                thread.join(0.5)
        except KeyboardInterrupt:
            pass
