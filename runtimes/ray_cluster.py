"""A Ray cluster's processes, found and stopped by PID: what ``run_on_ray`` leaves nothing of.

Every process of a private cluster inherits :data:`MARKER_ENV` (set to the
cluster's temporary directory); :class:`Cluster` remembers them by PID and
start time, and :func:`shutdown_ray` ends them after ``ray.shutdown()``.
Nothing is ever killed by name. Linux only (``/proc``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MARKER_ENV", "Cluster", "ray_processes", "shutdown_ray"]

MARKER_ENV = "QUORUM_RAY_CLUSTER"  # names the Ray cluster a process belongs to (see ray_processes)


def ray_processes(marker: str | Path) -> list[int]:
    """Return the pids of the live processes of the Ray cluster tagged ``marker``. Linux only.

    They are found by :data:`MARKER_ENV` in their environment, which all of
    them inherit (workers rename themselves ``ray::ClientAppActor``).
    """
    needle = f"{MARKER_ENV}={marker}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes() and _start_time(int(entry.name)):
                    pids.append(int(entry.name))
    return pids


def _start_time(pid: int) -> str | None:
    """Start time of a live, non-zombie process (field 22 of ``/proc/<pid>/stat``), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


@dataclass
class Cluster:
    """One call's Ray processes: by marker, and by PID (with start time) once seen.

    PIDs are kept because an exiting process has an empty ``/proc/<pid>/environ``.
    """

    temp_dir: str
    known: dict[int, str] = field(default_factory=dict)

    def snapshot(self) -> None:
        """Remember the cluster's processes now live, each with its start time."""
        for pid in ray_processes(self.temp_dir):
            self.known[pid] = _start_time(pid) or ""

    def alive(self) -> list[int]:
        """Return the sorted pids still alive: remembered ones (same start time) and any now tagged."""
        seen = {pid for pid, start in self.known.items() if start and _start_time(pid) == start}
        return sorted(seen | set(ray_processes(self.temp_dir)))


def shutdown_ray(cluster: Cluster, grace_s: float = 1.0, term_s: float = 10.0) -> None:
    """Shut Ray down, end the processes that outlive it, and remove its files.

    Actors that outlive it by ``grace_s`` (they notice their raylet is gone
    seconds later) get SIGTERM, then SIGKILL after ``term_s``.
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, term_s), (None, 5.0)):
        deadline = time.monotonic() + wait_s
        while cluster.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if sig is None:
            continue
        for pid in cluster.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
