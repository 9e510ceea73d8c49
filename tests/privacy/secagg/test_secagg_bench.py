"""The benchmark's --quick mode runs end to end and ends with its JSON figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

ROOT = Path(__file__).resolve().parents[3]
KEYS = {"complete_round_s", "kregular_round_s", "speedup_vs_flower_secagg",
        "speedup_vs_flower_secaggplus", "upload_ratio", "max_abs_error",
        "malicious_complete_round_s", "malicious_kregular_round_s", "malicious_overhead"}


def test_quick_benchmark_prints_the_figures():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "secagg.py"), "--quick"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)

    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures.keys() >= KEYS
    assert figures["clients"] == 10 and figures["params"] == 10_000
    assert figures["complete_round_s"] > 0 and figures["kregular_round_s"] > 0
    assert figures["speedup_vs_flower_secagg"] > 0 and figures["speedup_vs_flower_secaggplus"] > 0
    assert 1.0 < figures["upload_ratio"] < 1.1
    assert 0 < figures["max_abs_error"] <= figures["error_bound"]
    assert "Flower SecAgg+" in done.stdout and "ours kregular" in done.stdout
    assert figures["malicious_complete_round_s"] > 0 and figures["malicious_kregular_round_s"] > 0
    assert figures["malicious_overhead"] > 0  # the 1.3 goal is for the full size (bench/README.md)
    assert "ours complete, malicious model" in done.stdout and "consistency_check" in done.stdout
