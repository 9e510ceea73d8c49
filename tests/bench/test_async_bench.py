"""The asynchronous-aggregation benchmark (issue #15) runs ``--quick`` and ends with a sane JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "async.py"


def test_quick_benchmark_times_fedbuff_and_sync_on_one_clock() -> None:
    # Execute
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600,
                          check=False)

    # Assert: the keys; FedBuff, not waiting for the 10x stragglers, reaches the target sooner
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("fedbuff_time_to_target", "sync_time_to_target", "deadline_time_to_target", "speedup_vs_sync",
                "speedup_vs_deadline", "fedbuff_final_accuracy", "sync_final_accuracy"):
        assert key in figures, key
    assert figures["quick"] is True and len(figures["stragglers"]) == 2  # 30% of 8 clients
    assert figures["fedbuff_time_to_target"] is not None and figures["sync_time_to_target"] is not None
    ratio = figures["sync_time_to_target"] / figures["fedbuff_time_to_target"]
    assert figures["speedup_vs_sync"] == pytest.approx(ratio, rel=0.01)
    assert figures["speedup_vs_sync"] > 1
    # the deadline run turned the stragglers' replies into "late" errors and was timed at the deadline
    assert figures["deadline_late_replies"] > 0 and figures["deadline_time_to_target"] is not None
    assert figures["deadline_virtual_time_s"] < figures["sync_virtual_time_s"]  # dropping stragglers is faster
    assert 0 < figures["fedbuff_final_accuracy"] <= 100 and 0 < figures["sync_final_accuracy"] <= 100
