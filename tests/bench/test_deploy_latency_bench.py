"""The deployment-latency benchmark (issue #6) runs ``--quick`` against Flower's stock loop; its last line is sane."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.bench.programs import run_bench
from tests.deploy.conftest import needs_nginx

pytestmark = [pytest.mark.e2e, pytest.mark.heavy, needs_nginx]  # an aggregator behind nginx, agents, stock SuperNodes

BENCH = Path(__file__).resolve().parents[2] / "bench" / "deploy_latency.py"
PARTS = ("down_poll_s", "client_run_s", "train_s", "start_and_wait_s", "up_poll_s")


def test_quick_benchmark_times_a_round_of_ours_and_of_flowers_stock_loop() -> None:
    # Execute: one client and one round per side, on one loopback federation
    proc = run_bench(BENCH, "--quick", timeout_s=300)  # past it: SIGINT, so the bench stops its federation

    # Assert: the issue's keys; the ratio is the two round times' own
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (figures["clients"], figures["rounds"]) == (1, 1)
    round_s, stock_s = figures["round_s"], figures["stock_round_s"]
    for value in (round_s, stock_s, figures["speedup_vs_stock"]):
        assert math.isfinite(value) and value > 0, figures
    assert figures["speedup_vs_stock"] == pytest.approx(stock_s / round_s, rel=0.01)
    # each side's round splits into its parts (one machine, one clock: the SuperNode's log and the server's)
    for key in PARTS:
        assert math.isfinite(figures[key]) and math.isfinite(figures[f"stock_{key}"]), key
    assert figures["train_s"] <= figures["client_run_s"] < round_s + 0.1
    assert "round (push -> last reply)" in proc.stdout and "speed-up:" in proc.stdout
