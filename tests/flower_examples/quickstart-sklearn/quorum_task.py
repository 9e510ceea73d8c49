"""quickstart-sklearn's model, data and training as a Quorum task: the other way round (Quorum's ClientApp under
the example's own, stock ServerApp).

The example's ``task.py`` is called unchanged (its model factory, parameter
getters and setters, data loader); ``train`` and ``evaluate`` are the bodies
of its ``client_app.py`` handlers, moved as docs/tasks.md ("An existing Flower
app") says they move. The model that travels is the example's
``[coef_, intercept_]``, held in a module so that Quorum's ClientApp can
flatten it; the example's server sends it as ``ArrayRecord([coef, intercept])``
(keys ``"0"``, ``"1"``), which Quorum's client reads by position.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from sklearn.metrics import log_loss
from sklearnexample.task import (
    UNIQUE_LABELS,
    create_log_reg_and_instantiate_parameters,
    get_model_params,
    load_data,
    set_model_params,
)
from torch import nn

from core.instructions import TrainConfig
from learning.task import Metrics, Split, Task


@dataclass(frozen=True)
class Options:
    """The example's one ClientApp key (its pyproject's ``penalty``)."""

    penalty: str = "l2"


class Params(nn.Module):
    """A scikit-learn model's arrays, in ``get_model_params`` order, as trainable tensors."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        super().__init__()
        self.coef = nn.Parameter(torch.as_tensor(np.asarray(arrays[0], np.float32)))
        self.intercept = nn.Parameter(torch.as_tensor(np.asarray(arrays[1], np.float32)))

    def arrays(self) -> list[np.ndarray]:
        return [p.detach().numpy().astype(np.float64) for p in (self.coef, self.intercept)]

    def load(self, arrays: list[np.ndarray]) -> None:
        with torch.no_grad():
            for p, a in zip((self.coef, self.intercept), arrays, strict=True):
                p.copy_(torch.as_tensor(np.asarray(a, np.float32)))


class SklearnExampleTask(Task):
    Options: ClassVar[type] = Options

    def build_model(self, seed: int) -> nn.Module:  # noqa: ARG002 (Task's signature)
        return Params(get_model_params(create_log_reg_and_instantiate_parameters(self.options.penalty)))

    def partition(self, partition_id: int) -> Split:
        x_train, y_train, x_test, y_test = load_data(partition_id, self.scenario.federation.clients)
        return Split(train=(x_train, y_train), test=(x_test, y_test))

    def _sklearn(self, model: Any) -> Any:
        return set_model_params(create_log_reg_and_instantiate_parameters(self.options.penalty), model.arrays())

    def train(self, model: nn.Module, data: Any, config: TrainConfig, seed: int) -> Metrics:  # noqa: ARG002
        x_train, y_train = data
        sk = self._sklearn(model)
        with warnings.catch_warnings():  # the example's: convergence warnings at one local epoch
            warnings.simplefilter("ignore")
            sk.fit(x_train, y_train)
        train_logloss = log_loss(y_train, sk.predict_proba(x_train), labels=UNIQUE_LABELS)
        model.load(get_model_params(sk))
        return {"loss": train_logloss, "num_examples": len(x_train), "train_accuracy": sk.score(x_train, y_train)}

    def evaluate(self, model: nn.Module, data: Any) -> Metrics:
        x_test, y_test = data
        sk = self._sklearn(model)
        loss = log_loss(y_test, sk.predict_proba(x_test), labels=UNIQUE_LABELS)
        return {"loss": loss, "accuracy": sk.score(x_test, y_test), "num_examples": len(x_test)}
