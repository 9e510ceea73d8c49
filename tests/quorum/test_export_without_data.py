"""An export loads where its task's data are not (issue 47): serving needs only ``build_model``.

A task whose options name a data folder checks that folder when a run reads
the scenario; loading the export must not, or an export stops loading once
that folder is gone (a model moved to a serving host never has it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from quorum.errors import ExportError
from quorum.export import export_run, load_export
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
from scenarios.schema import scenario_from_dict

FOLDER_TASK = '''
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from learning.task import Split, Task
from scenarios.schema import bad_value


@dataclass(frozen=True)
class Options:
    data_dir: str = ""

    def _check(self):
        if not Path(self.data_dir).is_dir():
            raise bad_value("data_dir", self.data_dir, "no such folder")


class FolderTask(Task):
    """A linear regression on the arrays of data_dir/data.npz."""

    Options = Options

    def build_model(self, seed):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return nn.Linear(3, 1)

    def _arrays(self):
        with np.load(Path(self.options.data_dir) / "data.npz") as data:
            return torch.from_numpy(data["x"]), torch.from_numpy(data["y"])

    def server_data(self):
        return self._arrays()

    def partition(self, i):
        x, y = self._arrays()
        return Split(train=(x, y), test=(x, y))

    def train(self, model, data, config, seed):
        x, y = data
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return {"loss": loss.item(), "num_examples": len(y)}

    def evaluate(self, model, data):
        x, y = data
        with torch.no_grad():
            return {"loss": F.mse_loss(model(x), y).item(), "num_examples": len(y)}
'''


def test_an_export_loads_after_the_folder_its_task_options_name_is_gone(tmp_path: Path) -> None:
    # Prepare: a run of a task whose options name a data folder, exported
    project, data = tmp_path / "project", tmp_path / "data"
    project.mkdir()
    data.mkdir()
    (project / "folder_task.py").write_text(FOLDER_TASK)
    x = np.random.default_rng(0).standard_normal((32, 3)).astype(np.float32)
    np.savez(data / "data.npz", x=x, y=x.sum(axis=1, keepdims=True))
    raw = {"name": "folder", "rounds": 1, "federation": {"clients": 2, "min_clients": 1},
           "task": {"entry": "folder_task:FolderTask", "path": str(project), "data_dir": str(data)}}
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    run_id = simulate(scenario_from_dict(raw, source="folder.toml"), db_url=db, workers=1).run_id
    out = tmp_path / "export"
    export_run(RunStore(db), run_id, out)
    expected = load_export(out).module(torch.from_numpy(x)).detach()

    # Execute: the data folder is gone (the scenario itself is now refused), the export is loaded again
    shutil.rmtree(data)
    with pytest.raises(ScenarioError, match="task.data_dir = .*no such folder"):
        simulate(scenario_from_dict(raw, source="folder.toml"), db_url=db, workers=1)
    exported = load_export(out)

    # Assert: the same model, the same answers
    torch.testing.assert_close(exported.module(torch.from_numpy(x)).detach(), expected)


def test_an_export_whose_options_are_malformed_is_still_refused(tmp_path: Path) -> None:
    # Prepare: an export whose manifest was edited to give the task an option it does not have
    import json

    from quorum.export import MANIFEST

    test_an_export_loads_after_the_folder_its_task_options_name_is_gone(tmp_path)
    manifest_path = tmp_path / "export" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["scenario"]["task"]["options"] = {"no_such_option": 1}
    manifest_path.write_text(json.dumps(manifest))

    # Execute / Assert: types and names are still checked; only the task's own _check is not run
    with pytest.raises(ExportError, match="no_such_option"):
        load_export(tmp_path / "export")
