"""The compression benchmark (issue #16) runs ``--quick`` and ends with a sane JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "compression.py"


def test_quick_benchmark_measures_uplink_bytes_to_target_for_every_method() -> None:
    # Execute
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600,
                          check=False)

    # Assert: the keys, worked out again from the per-method figures the line carries
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    methods = figures["methods"]
    assert {"none", "8-bit", "4-bit", "top-k 1%", "random-k 10% secagg", "secagg dense"} <= set(methods)
    anchor = methods["none"]
    assert anchor["uplink_to_target"] is not None and figures["best_method"] in methods
    best = methods[figures["best_method"]]
    assert figures["best_uplink_reduction"] == pytest.approx(anchor["uplink_to_target"] / best["uplink_to_target"],
                                                             rel=0.01)
    reached = [m for m, r in methods.items() if r["uplink_to_target"] and "secagg" not in m and m != "none"]
    assert best["uplink_to_target"] == min(methods[m]["uplink_to_target"] for m in reached)
    assert figures["accuracy_drop_points"] == pytest.approx(100 * (anchor["final_accuracy"]
                                                                  - best["final_accuracy"]), abs=0.01)
    # measured, not estimated: quantised updates move fewer bytes than float32 ones over the same rounds
    assert methods["8-bit"]["uplink_bytes"] < anchor["uplink_bytes"]
    assert methods["4-bit"]["uplink_bytes"] < methods["8-bit"]["uplink_bytes"]
    assert figures["secagg_uplink_reduction"] is not None and figures["secagg_uplink_reduction"] > 1
