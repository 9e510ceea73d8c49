"""The DP trade-off benchmark (issue #4) runs ``--quick`` and ends with a sane JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

BENCH = Path(__file__).resolve().parents[3] / "bench" / "dp_tradeoff.py"


def test_quick_benchmark_prints_accuracy_and_epsilon_per_noise_level() -> None:
    proc = subprocess.run([sys.executable, "-W", "error", str(BENCH), "--quick"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures["accuracy"]) == set(figures["epsilon"]) == {"0", "0.3", "0.5", "1"}
    assert figures["epsilon"]["0"] is None  # no noise, no guarantee
    eps = [figures["epsilon"][k] for k in ("0.3", "0.5", "1")]
    assert eps == sorted(eps, reverse=True) and eps[-1] > 0
    assert all(0.0 <= a <= 1.0 for a in figures["accuracy"].values())
    assert "accuracy_drop_points_z1" in figures
