"""The language-model fine-tuning benchmark (issue #14) runs ``--quick`` and ends with consistent figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "finetune_llm.py"

pytest.importorskip("peft")


def test_quick_benchmark_reports_the_issues_figures() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=600,
                          check=False)

    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    base, fed, central = figures["base_perplexity"], figures["federated_perplexity"], figures["central_perplexity"]
    # both fine-tuned models beat the untouched base on the same held-out rows
    assert fed < base and central < base
    assert figures["federated_gain"] == pytest.approx((base - fed) / (base - central))
    # 4 clients x 2 rounds; the central run takes as many optimiser steps (3 each) as all of them together
    assert figures["client_updates"] == 8 and figures["central_steps"] == 8 * 3
    full = figures["full_model_bytes"]
    assert figures["traffic_ratio"] == pytest.approx(figures["traffic_bytes"] / (full * 8))
    # 8-bit updates: about one byte per adapter value (plus Flower's framing), far below the model's size
    assert figures["adapter_values"] <= figures["bytes_per_client_update"] < 2 * figures["adapter_values"]
    assert figures["bytes_per_client_update"] < 0.02 * full
    assert "| federated (8 client updates) |" in proc.stdout
