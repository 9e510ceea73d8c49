"""Helpers shared by the dashboard tests (kept out of conftest so tests can import them)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the repo root is the import root when quorum is not installed
    sys.path.insert(0, str(ROOT))

from core.records import ClientRecord, RoundRecord  # noqa: E402
from core.strategy import ServerState  # noqa: E402
from runstore.store import RunStore  # noqa: E402 (after the path fix)

#: Debian's Chromium, driven by Playwright (never a browser build Playwright would download), and its flags.
CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]

XSS_NAME = "<script>alert(1)</script>"
XSS_CLIENT = "<img src=x onerror=alert(2)>"
XSS_REASON = "<script>alert(3)</script>"


@dataclass(frozen=True)
class FilledStore:
    url: str
    sim_run: str
    dp_run: str
    xss_run: str


def state(round_: int) -> ServerState:
    """A tiny server state to commit synthetic rounds with."""
    return ServerState(params=np.arange(4, dtype=np.float32), round=round_)


def add_dp_run(store: RunStore) -> str:
    run_id = store.create_run(name="dp-secagg", scenario={"name": "dp-secagg", "dp": {"enabled": True}},
                              seed=1, strategy="fedavg", rounds=3)
    for n, eps, accuracy in ((1, 0.5, 0.6), (2, 0.75, 0.7)):
        stages = [{"stage": "advertise_keys", "completed": 4, "seconds": 0.01},
                  {"stage": "unmask", "completed": 3 - (n - 1), "bytes_up": 1024}]
        clients = [ClientRecord(client=str(c), outcome="ok", num_examples=10) for c in range(3)]
        clients.append(ClientRecord(client="3", outcome="dropped", stage="unmask"))
        store.commit_round(run_id, RoundRecord(round=n, started_at=1000.0 + n, duration_s=1.0, sampled=4,
                                               clients=clients, fed_accuracy=accuracy, epsilon=eps,
                                               secagg={"stages": stages}), state(n))
    store.set_status(run_id, "stopped_budget")
    return run_id


def add_xss_run(store: RunStore) -> str:
    run_id = store.create_run(name=XSS_NAME, scenario={"name": XSS_NAME, "description": XSS_CLIENT},
                              seed=0, strategy="fedavg", rounds=2)
    clients = [ClientRecord(client=XSS_CLIENT, outcome="rejected", stage="train", reason=XSS_REASON)]
    store.commit_round(run_id, RoundRecord(round=1, started_at=2000.0, duration_s=0.5, sampled=1,
                                           clients=clients), state(1))
    store.set_status(run_id, "failed", error=XSS_REASON)
    return run_id


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """Stop a process this test started, by its PID: TERM, then KILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
