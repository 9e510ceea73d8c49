"""``bench/parallel.py --quick`` runs and ends with its JSON line of figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from parallel_support import ROOT

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)


def test_quick_bench_prints_throughput_against_ddp_and_traffic():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["throughput_vs_ddp"] > 0
    assert figures["ours_samples_per_s"] > 0 and figures["ddp_samples_per_s"] > 0
    assert figures["max_param_diff"] < 1e-5  # both trainers took the same steps on the same data
    # Sync all-reduces the model every step; local SGD twice per epoch (the merge, then the mean update).
    steps, model_bytes = figures["sync_steps_per_epoch"], figures["sync_bytes_per_step"]
    assert figures["sync_bytes_per_epoch"] >= steps * model_bytes
    assert 2 * model_bytes <= figures["localsgd_bytes_per_epoch"] < 2.1 * model_bytes
