"""A task small enough to work out by hand: ``y = w . x`` without bias, mean squared error, full-batch SGD.

Client ``i`` holds the two rows of ``ROWS[i % len(ROWS)]``; every model starts
from ``W0``. A scenario names it with ``[task] entry =
"tests.aggregator.linear_task:LinearTask"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from core.instructions import TrainConfig
from learning.task import Metrics, NoOptions, Split, Task
from learning.training import train

__all__ = ["LinearTask", "ROWS", "W0"]

W0 = np.array([0.5, -1.0])
ROWS = (
    (np.array([[1.0, 2.0], [3.0, -1.0]]), np.array([1.0, 0.0])),
    (np.array([[2.0, 0.0], [0.0, 1.0]]), np.array([-1.0, 2.0])),
    (np.array([[1.0, 1.0], [-1.0, 2.0]]), np.array([0.5, 1.5])),
)


@dataclass(frozen=True)
class Rows:
    """A regression set: float targets, as ``learning.training.train`` takes with an MSE ``loss_fn``."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.squeeze(-1), target)


class LinearTask(Task):
    Options: ClassVar[type] = NoOptions
    supports_local_steps: ClassVar[bool] = True

    def build_model(self, seed: int) -> nn.Module:  # noqa: ARG002 (Task's signature)
        model = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.from_numpy(W0[None].astype(np.float32)))
        return model

    def partition(self, partition_id: int) -> Split:
        x, y = ROWS[partition_id % len(ROWS)]
        rows = Rows(x.astype(np.float32), y.astype(np.float32))
        return Split(train=rows, test=rows)

    def train(self, model: nn.Module, data: Any, config: TrainConfig, seed: int) -> Metrics:
        result = train(model, data, epochs=config.epochs, batch_size=len(data), lr=config.lr, seed=seed,
                       loss_fn=mse, steps=config.steps)
        return {"loss": float(result.loss), "num_examples": float(result.num_examples)}

    def evaluate(self, model: nn.Module, data: Any) -> Metrics:
        with torch.no_grad():
            loss = mse(model(torch.from_numpy(data.x)), torch.from_numpy(data.y))
        return {"loss": float(loss), "num_examples": float(len(data))}
