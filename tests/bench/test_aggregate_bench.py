"""The aggregation benchmark (issue #2) runs ``--quick`` and ends with a sane JSON line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "aggregate.py"
RATIOS = ("speedup_vs_flower", "speedup_vs_flower_cpu", "peak_memory_ratio", "ours_peak_growth")


@pytest.fixture(scope="module")
def run() -> tuple[str, dict[str, Any]]:
    """Run the quick benchmark once for every test here; return its stdout and JSON line."""
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--repeat", "1"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(proc.stdout.strip().splitlines()[-1])


def test_last_line_holds_the_issue_figures(run: tuple[str, dict[str, Any]]) -> None:
    # Prepare / Execute: the module fixture ran the benchmark
    _, figures = run

    # Assert
    for key in (*RATIOS, "ours_s", "flower_s", "ours_peak_mb", "flower_peak_mb",
                "ours_peak_mb_10_clients", "ours_peak_mb_100_clients", "max_rel_err"):
        assert key in figures, key
    assert (figures["clients"], figures["params"]) == (10, 100_000)


def test_ratios_are_positive_and_finite(run: tuple[str, dict[str, Any]]) -> None:
    _, figures = run

    for key in RATIOS:
        assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures[key])


def test_ours_equals_flowers_weighted_mean(run: tuple[str, dict[str, Any]]) -> None:
    _, figures = run

    assert figures["results_match"] is True
    assert figures["max_rel_err"] <= 1e-5


def test_our_peak_does_not_grow_with_clients_while_flowers_does(run: tuple[str, dict[str, Any]]) -> None:
    _, figures = run

    # ten times the clients: ours holds one reply at a time, Flower holds them all
    assert figures["ours_peak_mb_100_clients"] < 1.25 * figures["ours_peak_mb_10_clients"]
    assert figures["peak_memory_ratio"] < 1.0


def test_prints_a_readable_table_before_the_json(run: tuple[str, dict[str, Any]]) -> None:
    stdout, _ = run

    assert "Flower" in stdout and "ours" in stdout and "speedup vs Flower" in stdout
