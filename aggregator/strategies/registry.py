"""Each strategy's name, mapped to the function that builds it from its scenario settings.

``[strategy] name`` picks an entry of :data:`BUILDERS`; the entry builds the
strategy from the name's settings (``scenarios.strategies.STRATEGY_SETTINGS``),
``[strategy] server_lr`` and the scenario (what else a rule needs of it, such
as SCAFFOLD's population). ``aggregator.serverapp.build_strategy`` looks the
name up and wraps the strategy for DP when ``[dp]`` asks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aggregator.strategies.centered_clipping import CenteredClipping
from aggregator.strategies.fedavg import FedAvg
from aggregator.strategies.fedavgm import FedAvgM
from aggregator.strategies.fedopt import FedAdagrad, FedAdam, FedYogi
from aggregator.strategies.fedprox import FedProx
from aggregator.strategies.krum import Krum
from aggregator.strategies.median import FedMedian
from aggregator.strategies.scaffold import Scaffold
from aggregator.strategies.trimmed_mean import FedTrimmedMean
from core.strategy import Strategy
from scenarios.schema import Scenario
from scenarios.strategies import (
    CenteredClippingSettings,
    FedAdagradSettings,
    FedAdamSettings,
    FedAvgMSettings,
    FedProxSettings,
    FedYogiSettings,
    KrumSettings,
    StrategySettings,
    TrimmedMeanSettings,
)

__all__ = ["Builder", "BUILDERS", "build_base"]

#: Builds a strategy from its settings, ``server_lr`` and the scenario.
Builder = Callable[[Any, float, Scenario], Strategy[Any]]


def _fedavg(_settings: StrategySettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return FedAvg(server_lr=lr)


def _fedprox(s: FedProxSettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return FedProx(server_lr=lr, mu=s.mu)


def _fedavgm(s: FedAvgMSettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return FedAvgM(server_lr=lr, momentum=s.momentum)


def _fedadam(s: FedAdamSettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return FedAdam(server_lr=lr, beta1=s.beta1, beta2=s.beta2, tau=s.tau)


def _fedyogi(s: FedYogiSettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return FedYogi(server_lr=lr, beta1=s.beta1, beta2=s.beta2, tau=s.tau)


def _fedadagrad(s: FedAdagradSettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return FedAdagrad(server_lr=lr, beta1=s.beta1, tau=s.tau)


def _scaffold(_settings: StrategySettings, lr: float, scenario: Scenario) -> Strategy[Any]:
    return Scaffold(server_lr=lr, population=scenario.federation.clients)


def _centered_clipping(s: CenteredClippingSettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return CenteredClipping(clip_radius=s.clip_radius, bucket_size=s.bucket_size, momentum=s.momentum, server_lr=lr)


def _median(_settings: StrategySettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return FedMedian(server_lr=lr)


def _trimmed_mean(s: TrimmedMeanSettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return FedTrimmedMean(server_lr=lr, beta=s.trim_fraction)


def _krum(s: KrumSettings, lr: float, _scenario: Scenario) -> Strategy[Any]:
    return Krum(server_lr=lr, num_byzantine=s.num_byzantine, num_selected=s.num_selected)


#: ``[strategy] name`` -> the function building that strategy (the names of ``scenarios.strategies.STRATEGY_SETTINGS``).
BUILDERS: dict[str, Builder] = {
    "fedavg": _fedavg, "fedprox": _fedprox, "fedavgm": _fedavgm, "fedadam": _fedadam, "fedyogi": _fedyogi,
    "fedadagrad": _fedadagrad, "scaffold": _scaffold, "centered_clipping": _centered_clipping,
    "median": _median, "trimmed_mean": _trimmed_mean, "krum": _krum,
}


def build_base(scenario: Scenario) -> Strategy[Any]:
    """Build the scenario's strategy, as ``[strategy]`` names and sets it (without the DP wrapper)."""
    spec = scenario.strategy
    return BUILDERS[spec.name](spec.settings, spec.server_lr, scenario)
