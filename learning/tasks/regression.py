"""A built-in regression task: an MLP regressor on tabular data, MSE loss, MAE / RMSE / R^2.

Proof that the task interface is not classification in disguise: float
targets, a one-output model, a mean-squared-error training loop and its own
metrics. Two data sets, both without a download:

- ``diabetes``: scikit-learn's 442 diabetes patients (10 features, disease
  progression after one year; Efron et al., "Least Angle Regression", Annals
  of Statistics 2004), read straight from the scikit-learn wheel.
- ``friedman``: Friedman #1, generated: ``y = 10 sin(pi x1 x2) + 20 (x3 - 0.5)^2
  + 10 x4 + 5 x5 + noise`` on 10 uniform features of which 5 are irrelevant
  (Friedman, "Multivariate Adaptive Regression Splines", Annals of Statistics 1991).

Features and target are standardised with the whole set's mean and standard
deviation (public constants of the data set, not a client's statistics); the
model and the loss work in standard units, MAE and RMSE are reported in the
target's own units. The exported model (:meth:`RegressionTask.serving_module`)
carries those constants as buffers: it takes raw features and predicts in the
target's units.
"""

from __future__ import annotations

import functools
import importlib.util
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from core.instructions import TrainConfig
from learning.errors import DataError
from learning.partition import iid
from learning.task import Metrics, Split, Task
from learning.training import train
from scenarios.schema import Scenario, bad_value

__all__ = ["RegressionTask", "RegressionOptions", "RegressionData", "regression_metrics"]


@dataclass(frozen=True)
class RegressionOptions:
    """``[task]`` keys of :class:`RegressionTask`."""

    dataset: Literal["diabetes", "friedman"] = "diabetes"
    examples: int = 2000          # friedman: how many to generate
    noise: float = 1.0            # friedman: standard deviation of the noise
    hidden: int = 32              # units in each of the two hidden layers
    server_test_fraction: float = 0.2
    client_test_fraction: float = 0.1

    def _check(self) -> None:
        if not 10 <= self.examples <= 10_000_000:
            raise bad_value("examples", self.examples, "must be in [10, 10,000,000]")
        if not 0 <= self.noise <= 1e6:
            raise bad_value("noise", self.noise, "must be in [0, 1e6]")
        if not 1 <= self.hidden <= 65_536:
            raise bad_value("hidden", self.hidden, "must be in [1, 65,536]")
        for key in ("server_test_fraction", "client_test_fraction"):
            if not 0 <= getattr(self, key) < 1:
                raise bad_value(key, getattr(self, key), "must be in [0, 1)")


@dataclass(frozen=True)
class RegressionData:
    """Examples ``x`` (float32, ``(N, F)``) and standardised targets ``y`` (float32, ``(N,)``).

    ``scale`` is the target's standard deviation: an error in standard units
    times ``scale`` is an error in the target's own units.
    """

    x: np.ndarray
    y: np.ndarray
    scale: float = 1.0

    def __post_init__(self) -> None:
        """Refuse ``x`` or ``y`` that is not float32, ``x`` not 2-D, ``y`` not 1-D, or counts that differ."""
        if self.x.dtype != np.float32 or self.y.dtype != np.float32:
            raise ValueError(f"need float32 x and y, got {self.x.dtype} and {self.y.dtype}")
        if self.y.ndim != 1 or self.x.ndim != 2 or self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"x {self.x.shape} and y {self.y.shape} do not pair up")

    def __len__(self) -> int:
        """Return the number of examples."""
        return int(self.y.shape[0])

    def subset(self, index: np.ndarray) -> RegressionData:
        """Return the examples at ``index`` (a copy), with the same ``scale``."""
        return RegressionData(self.x[index], self.y[index], self.scale)


def regression_metrics(pred: np.ndarray, y: np.ndarray, scale: float = 1.0) -> Metrics:
    """MSE (standard units: the loss), MAE and RMSE (target units), R^2, and the count.

    R^2 is ``1 - SS_res / SS_tot`` over ``y`` (0 when ``y`` is constant).
    """
    pred, y = np.asarray(pred, dtype=np.float64).reshape(-1), np.asarray(y, dtype=np.float64).reshape(-1)
    if len(y) == 0:
        return {"loss": 0.0, "num_examples": 0.0}
    error = pred - y
    mse = float(np.mean(error**2))
    total = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(error**2)) / total if total > 0 else 0.0
    return {"loss": mse, "mae": float(np.mean(np.abs(error))) * scale, "rmse": float(np.sqrt(mse)) * scale,
            "r2": r2, "num_examples": float(len(y))}


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.squeeze(-1), target)


class RegressionTask(Task):
    """An MLP regressor (two hidden ReLU layers) trained with MSE; reports ``mae``, ``rmse``, ``r2``."""

    Options: ClassVar[type] = RegressionOptions
    supports_local_steps: ClassVar[bool] = True
    headline_metric: ClassVar[str | tuple[str, str] | None] = ("mae", "down")  # in the target's units

    def __init__(self, options: RegressionOptions, scenario: Scenario) -> None:
        super().__init__(options, scenario)
        self.options: RegressionOptions = options

    def _federation(self) -> tuple[tuple[Split, ...], RegressionData | None]:
        return _federation(self.options, self.scenario.federation.clients, self.scenario.seed)

    def build_model(self, seed: int) -> nn.Module:
        """Build the MLP from ``seed``, leaving the global RNG as it was."""
        features = _pool(self.options, self.scenario.seed).x.shape[1]
        hidden = self.options.hidden
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(operator.index(seed))
            return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def partition(self, partition_id: int) -> Split:
        """Return simulated client ``partition_id``'s split (modulo the federation's clients)."""
        clients, _ = self._federation()
        return clients[partition_id % len(clients)]

    def server_data(self) -> RegressionData | None:
        """Return the held-out test set (``None`` when none is held out)."""
        return self._federation()[1]

    def train(self, model: nn.Module, data: RegressionData, config: TrainConfig, seed: int) -> Metrics:
        """Train ``model`` with SGD on the MSE; return the loss and the count."""
        result = train(model, data, epochs=config.epochs, batch_size=config.batch_size, lr=config.lr,
                       momentum=config.momentum, proximal_mu=config.proximal_mu, seed=seed, loss_fn=_mse,
                       steps=config.steps)
        return {"loss": float(result.loss), "num_examples": float(result.num_examples)}

    def serving_module(self, model: nn.Module) -> nn.Module:
        """``model`` between the data set's standardisation and its inverse: raw features in, target units out."""
        x_mean, x_std, y_mean, y_scale = _standardisation(self.options, self.scenario.seed)
        return Standardised(model, x_mean, x_std, y_mean, y_scale)

    def evaluate(self, model: nn.Module, data: RegressionData) -> Metrics:
        """Score ``model`` on ``data`` (:func:`regression_metrics`)."""
        if len(data) == 0:
            return regression_metrics(np.zeros(0), np.zeros(0))
        model.eval()
        with torch.inference_mode():
            pred = model(torch.from_numpy(np.ascontiguousarray(data.x))).squeeze(-1).numpy()
        return regression_metrics(pred, data.y, data.scale)


class Standardised(nn.Module):
    """A regressor on standardised data, wrapped to take raw features and predict raw targets."""

    x_mean: torch.Tensor
    x_std: torch.Tensor
    y_mean: torch.Tensor
    y_scale: torch.Tensor

    def __init__(self, model: nn.Module, x_mean: np.ndarray, x_std: np.ndarray, y_mean: float,
                 y_scale: float) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("x_mean", torch.as_tensor(x_mean, dtype=torch.float32))
        self.register_buffer("x_std", torch.as_tensor(x_std, dtype=torch.float32))
        self.register_buffer("y_mean", torch.tensor(float(y_mean), dtype=torch.float32))
        self.register_buffer("y_scale", torch.tensor(float(y_scale), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model((x - self.x_mean) / self.x_std)
        return out * self.y_scale + self.y_mean


@functools.lru_cache(maxsize=4)
def _raw(options: RegressionOptions, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the whole data set in its own units (read or generated once per process)."""
    if options.dataset == "diabetes":
        return _diabetes()
    return _friedman1(options.examples, options.noise, np.random.default_rng(seed))


@functools.lru_cache(maxsize=4)
def _standardisation(options: RegressionOptions, seed: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """``(x_mean, x_std, y_mean, y_scale)`` of the whole set (a constant feature keeps std 1)."""
    x, y = _raw(options, seed)
    std = x.std(axis=0)
    return x.mean(axis=0), np.where(std > 0, std, 1.0), float(y.mean()), float(y.std()) or 1.0


@functools.lru_cache(maxsize=4)
def _pool(options: RegressionOptions, seed: int) -> RegressionData:
    """Return the whole data set, standardised."""
    x, y = _raw(options, seed)
    x_mean, x_std, y_mean, scale = _standardisation(options, seed)
    return RegressionData(((x - x_mean) / x_std).astype(np.float32), ((y - y_mean) / scale).astype(np.float32), scale)


@functools.lru_cache(maxsize=4)
def _federation(options: RegressionOptions, num_clients: int,
                seed: int) -> tuple[tuple[Split, ...], RegressionData | None]:
    """Server hold-out, then an IID split over ``num_clients``, each split into train and test."""
    pool = _pool(options, seed)
    holdout_rng, partition_rng, split_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    order = holdout_rng.permutation(len(pool))
    n_test = int(round(options.server_test_fraction * len(pool)))
    test = pool.subset(np.sort(order[:n_test])) if n_test else None
    rest = pool.subset(np.sort(order[n_test:]))
    if len(rest) < 2 * num_clients:
        raise DataError(f"{options.dataset}: {len(rest)} examples cannot feed {num_clients} clients")
    clients = []
    for part in iid(rest.y, num_clients, partition_rng):
        local = rest.subset(part)
        shuffled = split_rng.permutation(len(local))
        k = min(int(round(options.client_test_fraction * len(local))), len(local) - 1)
        clients.append(Split(local.subset(np.sort(shuffled[k:])), local.subset(np.sort(shuffled[:k]))))
    return tuple(clients), test


def _diabetes() -> tuple[np.ndarray, np.ndarray]:
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise DataError("sklearn: package not installed; it ships the diabetes data")
    folder = Path(spec.origin).parent / "datasets" / "data"
    return (np.loadtxt(folder / "diabetes_data_raw.csv.gz"), np.loadtxt(folder / "diabetes_target.csv.gz"))


def _friedman1(n: int, noise: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    x = rng.uniform(size=(n, 10))
    y = (10 * np.sin(np.pi * x[:, 0] * x[:, 1]) + 20 * (x[:, 2] - 0.5) ** 2 + 10 * x[:, 3] + 5 * x[:, 4]
         + noise * rng.standard_normal(n))
    return x, y
