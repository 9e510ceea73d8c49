"""The simulation-at-scale benchmark (issue #18) runs ``--quick`` and ends with a sane JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "simulate.py"
sys.path.insert(0, str(BENCH.parent))

from simulate import tree_memory_mb  # noqa: E402

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)


def test_quick_benchmark_times_one_process_and_the_pool() -> None:
    # Execute
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600,
                          check=False)

    # Assert: the keys, filled for the runtimes --quick runs; both runtimes give the same model
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("speedup_vs_ray", "memory_vs_ray", "pool_vs_single", "peak_pss_mb_30", "models_match"):
        assert key in figures, key
    assert figures["speedup_vs_ray"] is None and figures["memory_vs_ray"] is None  # --quick runs no Ray
    assert figures["pool_vs_single"] > 0
    assert figures["models_match"] is True and figures["max_abs_diff"] <= 1e-5
    # a pool's tree (the aggregator and its workers) holds at least one Python with torch: over 100 MB
    assert figures["peak_pss_mb_30"] > 100
    assert "| pool | 30 |" in proc.stdout and "| single | 30 |" in proc.stdout


def test_tree_memory_counts_a_forked_child_once_in_pss_and_twice_in_rss() -> None:
    # Prepare: a child that touches 200 MB of its own, then forks a grandchild that shares those pages
    script = ("import os, time\nb = bytearray(200 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\n"
              "if os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\nprint('ready', flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

        # Execute
        pss, rss = tree_memory_mb(proc.pid)

        # Assert: two processes map the 200 MB, so RSS counts it twice; PSS splits it, about once
        assert rss - pss > 150
        assert 200 < pss < 330
    finally:
        for pid in _descendants(proc.pid):
            os.kill(pid, 9)
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _descendants(pid: int) -> list[int]:
    from simulate import _tree

    return [p for p in _tree(pid) if p != pid]
