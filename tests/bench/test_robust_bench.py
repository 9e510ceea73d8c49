"""The robust-aggregation benchmark (issue #12) runs ``--quick`` and ends with a sane JSON line."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "robust.py"
AGGREGATORS = ("mean", "median", "trimmed_mean", "krum", "cc")
ATTACKS = ("none", "alie", "ipm", "signflip", "labelflip", "mimic", "weight_inflation", "absent")


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    """Run the quick benchmark once; return its last line, parsed."""
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_last_line_holds_the_issue_figures(figures: dict[str, Any]) -> None:
    for key in ("cc_worst_attack_accuracy", "cc_clean_accuracy", "mean_worst_attack_accuracy",
                "krum_worst_attack_accuracy", "median_worst_attack_accuracy", "cc_drop_points"):
        assert key in figures, key
    assert figures["quick"] is True and figures["attacker_data"] == "iid"


def test_table_has_every_aggregator_and_attack_as_a_percentage(figures: dict[str, Any]) -> None:
    table = figures["table"]
    assert list(table) == list(AGGREGATORS)
    for row in table.values():
        assert list(row) == list(ATTACKS)
        assert all(math.isfinite(v) and 0 <= v <= 100 for v in row.values())


def test_figures_agree_with_the_table(figures: dict[str, Any]) -> None:
    cc = figures["table"]["cc"]
    worst = min(v for k, v in cc.items() if k not in ("none", "absent"))  # the floor is no attack
    assert figures["cc_clean_accuracy"] == cc["none"] and figures["cc_worst_attack_accuracy"] == worst
    assert figures["cc_drop_points"] == pytest.approx(cc["none"] - worst, abs=0.01)
    assert figures["cc_floor_points"] == pytest.approx(cc["none"] - cc["absent"], abs=0.01)
