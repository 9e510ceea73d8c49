"""The failover benchmark (issue #35) runs ``--quick`` (one failover) and ends with a sane JSON line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.bench.programs import run_bench
from tests.deploy.conftest import needs_nginx

# PostgreSQL, two aggregators behind nginx, three agents; about 1.5-2 minutes, so scheduled first
pytestmark = [pytest.mark.e2e, pytest.mark.heavy, needs_nginx]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "failover.py"


def test_quick_benchmark_times_one_failover_against_a_round() -> None:
    # Execute
    proc = run_bench(BENCH, "--quick", timeout_s=420)  # past it: SIGINT, so the bench stops its federation

    # Assert: the keys, worked out again from the one failover the line carries
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(figures["failover_s"]) == 1
    (failover_s,) = figures["failover_s"]
    for key in ("median_s", "worst_s", "round_s", "ratio"):
        assert math.isfinite(figures[key]) and figures[key] > 0, (key, figures)
    assert figures["median_s"] == figures["worst_s"] == failover_s
    assert figures["ratio"] == pytest.approx(failover_s / figures["round_s"], rel=0.01)
    assert figures["rounds"] >= 2 and figures["dropped"] == 0, figures  # every device answered every round
    assert "failover 1/1:" in proc.stdout and "kill -> first message" in proc.stdout
