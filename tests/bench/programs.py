"""Running a benchmark that starts a federation of its own, so that a timeout still stops that federation."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["run_bench"]


def run_bench(script: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run ``script args`` with this Python; return it completed, its output captured.

    Past ``timeout_s`` the benchmark gets SIGINT, not SIGKILL: its ``finally``
    stops the aggregators, devices and database it started (by PID), which a
    killed benchmark would leave running. It has 60 s for that, then is killed.

    Raises
    ------
    subprocess.TimeoutExpired
        The benchmark ran past ``timeout_s`` (its output so far attached).
    """
    with subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                out, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout_s, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
