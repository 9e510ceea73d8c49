"""The edge-aggregator benchmark (issue #49) runs ``--quick`` and ends with the issue's JSON keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "hierarchy.py"

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)


def test_quick_benchmark_compares_a_tree_with_the_flat_federation() -> None:
    # Execute: 200 devices flat and under 10 edges, then 2,000 under 100 edges
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600,
                          check=False)

    # Assert: the keys; every device answered, so the aggregator got 10 messages instead of 200
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("top_bytes_ratio", "top_messages_ratio", "round_time_ratio", "models_match", "pss_100k_over_10k"):
        assert figures[key] is not None, key
    assert figures["top_messages_ratio"] == 20.0
    # each edge's sum is one device reply's size, plus a row per device: between 10x and 20x fewer bytes
    assert 10 < figures["top_bytes_ratio"] < 20
    assert figures["models_match"] is True and figures["max_abs_diff"] <= 1e-6
    assert figures["round_time_ratio"] > 0 and figures["pss_100k_over_10k"] > 0
    assert "| tree | 200 | 10 |" in proc.stdout and "| flat | 200 | 0 |" in proc.stdout
    assert "| tree-10x | 2,000 | 100 |" in proc.stdout
