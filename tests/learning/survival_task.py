"""A survival task for the tests: a linear Cox proportional-hazards model, six hospitals, Harrell's C-index.

Each client (a hospital) holds its own rows, drawn in code from a known model:
features ``x ~ N(shift, 1)`` (the shift differs per hospital), an event time
``T ~ Exponential(rate = BASE_RATE * exp(x . BETA))`` and an independent
censoring time ``C ~ Exponential(CENSOR_RATE)``; a row records ``time =
min(T, C)`` and ``event = T <= C``. :data:`HOSPITALS` gives each hospital's
training and test rows and its shift, so the federated C-index is a weighted
mean of six different values.

The model is ``log h(t | x) = log h0(t) + x . beta`` (Cox 1972) with ``beta`` a
bias-free linear layer (its flat parameters are ``beta`` itself), trained by
full-batch gradient descent on the negative Cox partial log-likelihood
(Breslow's handling of ties). :meth:`SurvivalTask.evaluate` reports that loss
and Harrell's concordance index (Harrell et al., JAMA 1982), computed in numpy.
A scenario names it with ``[task] entry =
"tests.learning.survival_task:SurvivalTask"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from core.instructions import TrainConfig
from learning.task import Metrics, Split, Task
from scenarios.schema import bad_value

__all__ = ["SurvivalTask", "SurvivalOptions", "SurvivalRows", "c_index", "cox_loss", "hospital", "BETA",
           "HOSPITALS"]

#: The coefficients the data are drawn from: a model that learns them ranks the risks well.
BETA = np.array([1.2, -1.0, 0.8, 0.0, -0.6, 0.9])
#: Each hospital's (training rows, test rows, feature shift): sizes and populations differ.
HOSPITALS = ((120, 40, -0.5), (160, 48, -0.3), (90, 36, -0.1), (200, 60, 0.1), (140, 44, 0.3), (110, 52, 0.5))
BASE_RATE, CENSOR_RATE = 0.1, 0.05


@dataclass(frozen=True)
class SurvivalOptions:
    """``[task]`` keys of :class:`SurvivalTask`."""

    steps: int = 10  # full-batch gradient steps per round

    def _check(self) -> None:
        if not 1 <= self.steps <= 10_000:
            raise bad_value("steps", self.steps, "must be in [1, 10,000]")


@dataclass(frozen=True)
class SurvivalRows:
    """Right-censored rows: features, the time observed, and whether it is an event (1) or a censoring (0)."""

    x: np.ndarray
    time: np.ndarray
    event: np.ndarray

    def __len__(self) -> int:
        return len(self.time)


def cox_loss(log_risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor) -> torch.Tensor:
    """The negative Cox partial log-likelihood per event: each event's log-risk against the log-sum of the
    risks still at risk at its time (every row observed at least as long; Breslow's ties)."""
    order = torch.argsort(time, descending=True)
    risk, happened = log_risk[order], event[order]
    at_risk = torch.logcumsumexp(risk, dim=0)
    return -((risk - at_risk) * happened).sum() / happened.sum().clamp(min=1.0)


def c_index(risk: np.ndarray, time: np.ndarray, event: np.ndarray) -> float:
    """Harrell's C: among pairs whose shorter time is an event, the share the model ranks riskier first.

    A pair ``(i, j)`` is comparable when ``time_i < time_j`` and row ``i``
    had its event; it is concordant when ``risk_i > risk_j`` (a tie counts
    half). 0.5 when no pair is comparable.
    """
    risk, time, event = (np.asarray(a, dtype=np.float64).reshape(-1) for a in (risk, time, event))
    comparable = (event[:, None] > 0) & (time[:, None] < time[None, :])
    if not comparable.any():
        return 0.5
    concordant = (risk[:, None] > risk[None, :]) + 0.5 * (risk[:, None] == risk[None, :])
    return float((comparable * concordant).sum() / comparable.sum())


def hospital(index: int, seed: int) -> Split:
    """Hospital ``index``'s own rows (:data:`HOSPITALS`), drawn from ``seed``: a training and a test part."""
    n_train, n_test, shift = HOSPITALS[index]
    rng = np.random.default_rng([seed, index])
    x = rng.normal(shift, 1.0, size=(n_train + n_test, BETA.size))
    event_time = rng.exponential(1.0 / (BASE_RATE * np.exp(x @ BETA)))
    censor_time = rng.exponential(1.0 / CENSOR_RATE, size=len(x))
    time = np.minimum(event_time, censor_time).astype(np.float32)
    event = (event_time <= censor_time).astype(np.float32)
    x = x.astype(np.float32)
    return Split(train=SurvivalRows(x[:n_train], time[:n_train], event[:n_train]),
                 test=SurvivalRows(x[n_train:], time[n_train:], event[n_train:]))


class SurvivalTask(Task):
    """Cox proportional hazards, linear in six features; judged by Harrell's C-index (higher is better)."""

    Options: ClassVar[type] = SurvivalOptions
    headline_metric: ClassVar[str | tuple[str, str] | None] = ("c_index", "up")

    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return nn.Linear(BETA.size, 1, bias=False)

    def partition(self, partition_id: int) -> Split:
        return hospital(partition_id % len(HOSPITALS), self.scenario.seed)

    def train(self, model: nn.Module, data: Any, config: TrainConfig, seed: int) -> Metrics:  # noqa: ARG002
        x, time, event = (torch.from_numpy(a) for a in (data.x, data.time, data.event))
        optimiser = torch.optim.SGD(model.parameters(), lr=config.lr)
        model.train()
        losses = []
        for _ in range(self.options.steps):
            optimiser.zero_grad()
            loss = cox_loss(model(x).squeeze(-1), time, event)
            loss.backward()
            optimiser.step()
            losses.append(float(loss.detach()))
        return {"loss": float(np.mean(losses)), "num_examples": float(len(data))}

    def evaluate(self, model: nn.Module, data: Any) -> Metrics:
        model.eval()
        with torch.inference_mode():
            log_risk = model(torch.from_numpy(data.x)).squeeze(-1)
            loss = float(cox_loss(log_risk, torch.from_numpy(data.time), torch.from_numpy(data.event)))
        return {"loss": loss, "c_index": c_index(log_risk.numpy(), data.time, data.event),
                "num_examples": float(len(data))}
