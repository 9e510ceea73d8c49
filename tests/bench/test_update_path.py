"""bench/update_path.py: one round's updates cross the server's files once, in order, and end in the run store."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_an_updates_path_reaches_the_store_through_one_runlog_without_a_round_trip() -> None:
    spec = importlib.util.spec_from_file_location("update_path", ROOT / "bench" / "update_path.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    result = module.measure(ROOT)  # one in-process round, profiled

    files = result["files"]
    # the reply is parsed, folded by the strategy, applied, and committed through the RunLog, in that order
    steps = ["aggregator/train.py", "core/replies.py", "core/strategy.py", "aggregator/step.py",
             "aggregator/strategies/fedavg.py", "runstore/runlog.py", "runstore/store.py", "runstore/checkpoints.py"]
    assert [files.index(f) for f in steps] == sorted(files.index(f) for f in steps), files
    assert not [f for f in files if f.startswith(("clients/", "learning/"))]  # no client code on the server's path
    assert result["round_trips"] == []  # no aggregator -> core -> aggregator call backs
    assert len(files) <= 19, files  # 19 before the architecture step (5c91da4^); 20 at its start


@pytest.mark.e2e  # a real process (docs/testing.md)
def test_quick_run_as_a_program_ends_with_the_three_counts() -> None:
    # Execute
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "update_path.py"), "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)

    # Assert: the counts of bench/README.md's table, as the summary printed them (the bound on the files is
    # the in-process test's above)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["quick"] is True and figures["round_trips"] == 0
    assert figures["files"] > 0 and figures["cross_package_calls"] > 0
    assert f"server files: {figures['files']}; cross-package calls: {figures['cross_package_calls']} " in proc.stdout
