"""Issue 34's architecture step changes no result: the quickstart trains the bit-identical model before and after.

The code as it was before the step's first commit (``git archive`` of
``BEFORE`` into a temporary folder) and the code of this checkout each run the
shipped quickstart with the same seed, in a process of their own with one
worker (replies folded in one order), on this machine's one installation of
torch and Flower. The final models must be equal bit for bit. The "before"
run's store is read by today's store, which migrates it on open.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runstore.store import RunStore
from tests.conftest import REPO

pytestmark = pytest.mark.e2e  # two `quorum simulate` processes (docs/testing.md)

#: The last commit before issue 34's architecture step (5c91da4 is its first).
BEFORE = "5c91da4^"
#: Runs the `quorum` command of the source tree named first, and refuses to run another tree's code.
RUN_TREE = """
import sys
tree = sys.argv[1]
sys.path.insert(0, tree)
import aggregator, core, quorum
for package in (aggregator, core, quorum):
    assert package.__file__.startswith(tree), f"{package.__name__} imported from {package.__file__}, not {tree}"
from quorum.cli import main
sys.argv = ["quorum", *sys.argv[2:]]
main()
"""


def _has_history() -> bool:
    git = shutil.which("git")
    return git is not None and subprocess.run([git, "-C", str(REPO), "cat-file", "-e", f"{BEFORE}^{{commit}}"],
                                              capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _has_history(), reason=f"not a git checkout holding {BEFORE} (a source archive)")
def test_the_quickstart_trains_the_bit_identical_model_before_and_after_the_architecture_step(tmp_path: Path) -> None:
    # Prepare: the tree before the step, beside this one
    before = tmp_path / "before"
    before.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", BEFORE], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
    script = tmp_path / "run_tree.py"
    script.write_text(RUN_TREE)

    # Execute: the quickstart, two rounds, one worker, in both trees at once
    runs = {}
    for name, tree in (("before", before), ("after", REPO)):
        db = f"sqlite:///{tmp_path / name}.db"
        runs[name] = (db, subprocess.Popen(
            [sys.executable, str(script), str(tree), "simulate", "scenarios/quickstart.toml", "--rounds", "2",
             "--workers", "1", "--json", "--db", db],
            cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = {name: proc.communicate(timeout=300)[0] for name, (_, proc) in runs.items()}

    # Assert: both finished, and their models are the same bits
    params = {}
    for name, (db, proc) in runs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name][-3000:]}"
        store = RunStore(db, checkpoint_dir=tmp_path / f"{name}-checkpoints")
        (run,) = store.list_runs()
        assert (run.status, run.rounds_done) == ("finished", 2), f"{name}: {run.status} {run.error}"
        state = store.load_state(run.id)
        assert state is not None
        params[name] = state.params
    assert params["before"].dtype == params["after"].dtype == np.float32
    assert params["before"].tobytes() == params["after"].tobytes()
