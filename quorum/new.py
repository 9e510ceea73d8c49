"""``quorum new NAME``: a project folder with a task of one's own, a scenario and a README.

The folder runs at once (``quorum simulate NAME/scenario.toml``); ``task.py``
is the documented place for the user's model, data and training loop. The
scenario names the task as ``entry = "task:MyTask"``, which the scenario
loader resolves in the scenario's own folder (docs/tasks.md).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["create_project", "ProjectError", "TASK_TEMPLATE", "SCENARIO_TEMPLATE", "README_TEMPLATE"]


class ProjectError(ValueError):
    """The project cannot be created here; the message names the folder and why."""


TASK_TEMPLATE = '''"""{name}: the model, the data and the training loop that Quorum federates.

Quorum calls this class on every client and on the aggregator:

- ``build_model(seed)``: your torch model, identical everywhere for one seed
  (or load a pretrained checkpoint here: the start of fine-tuning). Freeze a
  layer with ``p.requires_grad_(False)`` and it never leaves the device: only
  trainable parameters travel and are aggregated.
- ``partition(i)``: client ``i``'s data in a simulation; ``device_data(path)``
  reads a real device's own file (it never leaves the device).
- ``server_data()``: the aggregator's held-out set (``None``: no server-side evaluation).
- ``train(model, data, config, seed)``: one round of local training; return at
  least ``loss`` and ``num_examples``. ``config`` has the round's ``epochs``,
  ``batch_size``, ``lr``, ``momentum`` and ``proximal_mu``.
- ``evaluate(model, data)``: ``loss``, ``num_examples`` and any named metrics
  (``accuracy`` is what federated evaluation reports; add ``f1``, ``auc``, ...).

The keys of ``[task]`` in scenario.toml (besides ``entry``) are the fields of
``Options``: typed, with defaults, checked when the scenario loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from core.instructions import TrainConfig
from learning.datasets import load_digits, load_file
from learning.task import Split, Task
from scenarios.schema import bad_value

Data = tuple[torch.Tensor, torch.Tensor]  # (examples, labels)


@dataclass(frozen=True)
class Options:
    """This task's keys in scenario.toml's ``[task]`` table."""

    hidden: int = 64              # hidden units of the MLP
    server_fraction: float = 0.2  # share of the examples the aggregator keeps to evaluate on

    def _check(self) -> None:
        if self.hidden < 1:
            raise bad_value("hidden", self.hidden, "must be >= 1")
        if not 0 <= self.server_fraction < 1:
            raise bad_value("server_fraction", self.server_fraction, "must be in [0, 1)")


class MyTask(Task):
    """Handwritten digits (8x8, 10 classes) with a one-hidden-layer MLP: replace with your own."""

    Options = Options
    num_classes = 10  # quorum serve answers class probabilities; the input shape is read from the data

    # -- the model ------------------------------------------------------------
    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):  # seed the initialisation, leave the global RNG alone
            torch.manual_seed(seed)
            return nn.Sequential(
                nn.Flatten(),
                nn.Linear(64, self.options.hidden), nn.ReLU(),
                nn.Linear(self.options.hidden, 10),
            )

    # -- the data -------------------------------------------------------------
    def _examples(self) -> Data:
        """All examples: replace with your own loader (numpy arrays, a CSV, a torchvision data set...)."""
        digits = load_digits()
        return torch.from_numpy(digits.x.reshape(len(digits), -1)), torch.from_numpy(digits.y)

    def _shuffled(self) -> Data:
        x, y = self._examples()
        order = torch.from_numpy(np.random.default_rng(self.scenario.seed).permutation(len(y)))
        return x[order], y[order]

    def server_data(self) -> Data | None:
        x, y = self._shuffled()
        n = int(self.options.server_fraction * len(y))
        return (x[:n], y[:n]) if n else None

    def partition(self, partition_id: int) -> Split:
        x, y = self._shuffled()
        start = int(self.options.server_fraction * len(y))
        clients = self.scenario.federation.clients
        part = torch.arange(start, len(y))[partition_id % clients::clients]  # every clients-th example
        cut = max(1, int(0.9 * len(part)))  # 90% to train on, 10% to evaluate on
        return Split(train=(x[part[:cut]], y[part[:cut]]), test=(x[part[cut:]], y[part[cut:]]))

    def device_data(self, path: str) -> Split:
        """A real device's own ``.npz`` file with arrays ``x`` and ``y`` (or a ``.csv`` with a ``label`` column).

        ``load_file`` reads it within a size cap and checks it (finite float32
        features, integer labels): a bad value is named by its row and column.
        """
        data = load_file(path)
        x, y = torch.from_numpy(data.x.reshape(len(data), -1)), torch.from_numpy(data.y)
        cut = max(1, int(0.9 * len(y)))
        return Split(train=(x[:cut], y[:cut]), test=(x[cut:], y[cut:]))

    # -- training and evaluation --------------------------------------------------
    def train(self, model: nn.Module, data: Data, config: TrainConfig, seed: int) -> dict[str, float]:
        x, y = data
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
        generator = torch.Generator().manual_seed(seed)
        model.train()
        total = 0.0
        for _ in range(config.epochs):
            total = 0.0
            for batch in torch.randperm(len(y), generator=generator).split(config.batch_size):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x[batch]), y[batch])
                loss.backward()
                optimizer.step()
                total += loss.item() * len(batch)
        return {{"loss": total / len(y), "num_examples": len(y)}}

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:
        x, y = data
        if len(y) == 0:
            return {{"loss": 0.0, "accuracy": 0.0, "num_examples": 0}}
        model.eval()
        with torch.inference_mode():
            logits = model(x)
            loss = F.cross_entropy(logits, y).item()
            accuracy = (logits.argmax(dim=1) == y).float().mean().item()
        return {{"loss": loss, "accuracy": accuracy, "num_examples": len(y)}}
'''

SCENARIO_TEMPLATE = '''# {name}: your task (task.py) federated over simulated clients.
# Run it:  quorum simulate {name}/scenario.toml
name = "{name}"
seed = 0                         # one seed drives data split, sampling and training
rounds = 5

[task]
entry = "task:MyTask"            # module:Class, imported from this file's folder
hidden = 64                      # MyTask.Options: the task's own keys

[federation]
clients = 5                      # simulated clients: partition(0) .. partition(4)
fraction = 1.0                   # share of clients sampled per round
min_clients = 2                  # fewer usable updates than this skips the round

[training]                       # what train() receives as config
local_epochs = 2
batch_size = 16
lr = 0.1

[strategy]
name = "fedavg"

[evaluation]
federated = true                 # clients score the model on their test split (needs "accuracy")
server = true                    # the aggregator scores it on server_data()
'''

README_TEMPLATE = '''# {name}

A Quorum project: your own model, data and training loop, federated.

- `task.py`: `MyTask`, with the model (`build_model`), the data (`partition`,
  `device_data`, `server_data`), the training loop (`train`) and the metrics
  (`evaluate`); `Options` declares the task's own scenario keys.
- `scenario.toml`: the federation: `[task] entry = "task:MyTask"` and its
  keys, clients, rounds, training settings, strategy, privacy.

```bash
quorum simulate {name}/scenario.toml       # run it on this machine, every round stored
quorum dashboard                           # watch the rounds, the task's metrics included
quorum report RUN_ID                       # PNG plots and a JSON summary
quorum export RUN_ID --out model/          # the trained model, with a copy of task.py: loads without this folder
quorum serve model/                        # POST /predict on http://127.0.0.1:8080
```

Start from `task.py`: replace `_examples` with your data and `build_model`
with your model; keep `train` and `evaluate` returning `loss`,
`num_examples` and your metrics. The walk-through from here to a deployed
federation (secure aggregation, differential privacy, real devices) is in
Quorum's `docs/tasks.md`.
'''

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def create_project(path: str | Path) -> list[Path]:
    """Create the project folder ``path`` with ``task.py``, ``scenario.toml`` and ``README.md``.

    Raises
    ------
    ProjectError
        The folder's name is not a plain name, or the folder exists and is not empty.
    """
    folder = Path(path)
    name = folder.name
    if not _NAME.match(name):
        raise ProjectError(f"{path}: the project name {name!r} must be letters, digits, '_', '-' or '.' "
                           "(64 at most), starting with a letter or digit")
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ProjectError(f"{folder}: already exists and is not an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    files = {"task.py": TASK_TEMPLATE, "scenario.toml": SCENARIO_TEMPLATE, "README.md": README_TEMPLATE}
    written = []
    for filename, template in files.items():
        target = folder / filename
        target.write_text(template.format(name=name), encoding="utf-8")
        written.append(target)
    return written
