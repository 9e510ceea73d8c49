"""The built-in classification task: the scenario's ``[data]`` set and ``[model]``, cross-entropy, accuracy.

This is what a scenario without ``[task] entry`` runs: MNIST, digits, FedProx
Synthetic or a user's CSV/NPZ file, partitioned as ``[data]`` says, with the
``logreg`` / ``mlp`` / ``cnn`` of ``learning.models``. Every tensor of those
models trains, so the vector that travels is the whole ``state_dict``, as
before tasks existed: same seeds, same order of operations, same numbers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from torch import nn

from core.instructions import TrainConfig
from learning.datasets import ArrayDataset, ClientData, Federation, csv_header, load_client_data
from learning.errors import DataError
from learning.federation import cached_federation
from learning.models import build_model
from learning.task import Metrics, NoOptions, Task
from learning.training import evaluate, train
from scenarios.schema import Scenario

__all__ = ["ClassificationTask"]


class ClassificationTask(Task):
    """Image or tabular classification on the scenario's ``[data]`` with the ``[model]`` it names."""

    Options: ClassVar[type] = NoOptions
    supports_dp_sgd: ClassVar[bool] = True
    supports_local_steps: ClassVar[bool] = True
    headline_metric: ClassVar[str | tuple[str, str] | None] = ("accuracy", "up")

    def __init__(self, options: Any, scenario: Scenario) -> None:
        super().__init__(options, scenario)
        self._device_shape: tuple[tuple[int, ...], int] | None = None

    def _federation(self) -> Federation:
        return cached_federation(self.scenario)

    @property
    def devices_only(self) -> bool:
        """``dataset = "file"`` without a ``path``: the data live on the devices alone."""
        return self.scenario.data.dataset == "file" and not self.scenario.data.path

    @property
    def input_shape(self) -> tuple[int, ...] | None:
        """One example's shape, ``(data.features,)`` when the data live on the devices alone; else ``None``."""
        return (self.scenario.data.features,) if self.devices_only else None

    @property
    def num_classes(self) -> int | None:
        """``data.classes`` when the data live on the devices alone; else ``None``."""
        return self.scenario.data.classes if self.devices_only else None

    def build_model(self, seed: int) -> nn.Module:
        """Build the ``[model]`` the scenario names from ``seed``, for its data's input shape and classes.

        The shape and classes come from ``[data]`` when the data live on the
        devices alone, else from a device file read on this node, else from the
        federation's data set.
        """
        shape: tuple[int, ...]
        if self.devices_only:
            shape, classes = (self.scenario.data.features,), self.scenario.data.classes
        elif self._device_shape is not None:
            shape, classes = self._device_shape
        else:
            fed = self._federation()
            shape, classes = fed.input_shape, fed.num_classes
        return build_model(self.scenario.model.name, shape, classes, seed=seed)

    def partition(self, partition_id: int) -> ClientData:
        """Return simulated client ``partition_id``'s data (modulo the federation's clients).

        Raises
        ------
        DataError
            ``dataset = "file"`` without ``data.path``: there are no simulated clients.
        """
        if self.devices_only:
            raise DataError("dataset = 'file' without data.path has no simulated clients: each deployed device "
                            "trains on its own file (quorum client start --data FILE)")
        fed = self._federation()
        return fed.clients[partition_id % len(fed.clients)]

    def device_data(self, path: str) -> ClientData:
        """Read the device's own CSV or NPZ file, split into train and test by ``client_test_fraction``.

        With ``dataset = "file"`` the model's input shape and classes come from
        this file (the aggregator reads its own copy at ``[data] path``);
        otherwise from the named data set.
        """
        spec = self.scenario.data
        data = load_client_data(path, label_column=spec.label_column, test_fraction=spec.client_test_fraction,
                                seed=self.scenario.seed)
        if self.devices_only:
            _check_device_file(path, data, spec.features, spec.classes, spec.label_column)
        elif spec.dataset == "file":
            self._device_shape = (tuple(data.train.x.shape[1:]), int(data.train.y.max()) + 1)
        return data

    def server_data(self) -> ArrayDataset | None:
        """Return the federation's held-out test set (``None`` when the data live on the devices alone)."""
        return None if self.devices_only else self._federation().test

    def train(self, model: nn.Module, data: ArrayDataset, config: TrainConfig, seed: int) -> Metrics:
        """Train ``model`` with SGD (:func:`learning.training.train`); return the loss and the count."""
        result = train(model, data, epochs=config.epochs, batch_size=config.batch_size, lr=config.lr,
                       momentum=config.momentum, proximal_mu=config.proximal_mu, seed=seed, steps=config.steps)
        return {"loss": float(result.loss), "num_examples": float(result.num_examples)}

    def evaluate(self, model: nn.Module, data: ArrayDataset) -> Metrics:
        """Score ``model`` on ``data``: loss, accuracy and the count."""
        result = evaluate(model, data)
        return {"loss": float(result.loss), "accuracy": float(result.accuracy),
                "num_examples": float(result.num_examples)}


def _check_device_file(path: str, data: ClientData, features: int, classes: int,
                       label_column: str = "label") -> None:
    """Check a device's file against the scenario's ``data.features`` and ``data.classes``.

    The error names the mismatch (for a CSV, the columns too many or the ones
    it has).
    """
    found = int(np.prod(data.train.x.shape[1:]))
    if found != features:
        names = [n for n in csv_header(path) if n != label_column] if path.lower().endswith(".csv") else []
        raise DataError(f"{path}: {found} feature columns besides the label; the scenario expects "
                        f"data.features = {features}{_columns_off(names, features)}")
    labels = np.concatenate([data.train.y, data.test.y])
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise DataError(f"{path}: labels run from {labels.min()} to {labels.max()}; the scenario expects "
                        f"0 .. {classes - 1} (data.classes = {classes})")


#: Column names that are a row's number or id, not a feature (pandas writes "Unnamed: 0" for its index).
_NOT_FEATURES = ("", "id", "index", "row", "#", "unnamed: 0")


def _columns_off(names: list[str], features: int) -> str:
    """Which columns a file has too many (the index-like ones, else its last), or what it has when it lacks some."""
    if not names or len(names) == features:
        return ""
    if len(names) < features:
        shown = ", ".join(repr(n) for n in names[:4]) + (f", ... {names[-1]!r}" if len(names) > 4 else "")
        return f": {features - len(names)} missing (it has {shown}); add them, or set data.features"
    extra = [n for n in names if n.strip().lower() in _NOT_FEATURES or n.lower().startswith("unnamed")]
    extra = extra[: len(names) - features] or names[features:]
    which = ", ".join(repr(n) for n in extra[:3]) + (", ..." if len(extra) > 3 else "")
    if len(extra) == 1:
        return f": column {which} is one too many; remove it from the file, or set data.features = {len(names)}"
    return (f": columns {which} are {len(extra)} too many; remove them from the file, or set "
            f"data.features = {len(names)}")
