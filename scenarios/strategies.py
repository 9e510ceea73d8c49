"""Each strategy's own settings, the table ``[strategy.<name>]`` of a scenario.

Every strategy reads ``[strategy] server_lr`` and the keys of its own frozen
dataclass here, nothing else: :data:`STRATEGY_SETTINGS` maps each name of
``[strategy] name`` to that class (``aggregator.strategies.registry`` maps it
to the strategy built from it). Each class validates its own keys in
``_check``; :class:`scenarios.sections.StrategySpec` reads the sub-table of the
chosen strategy into one (and the flat keys of files written before the
sub-tables existed), and refuses a sub-table or a key that the chosen strategy
would ignore. The keys, their defaults and each rule: docs/strategies.md.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from scenarios.bounds import MAX_CLIENTS
from scenarios.parse import Bad, build, fraction, within

__all__ = [
    "StrategySettings", "FedAvgSettings", "FedProxSettings", "FedAvgMSettings", "FedAdamSettings",
    "FedYogiSettings", "FedAdagradSettings", "ScaffoldSettings", "CenteredClippingSettings", "MedianSettings",
    "TrimmedMeanSettings", "KrumSettings", "STRATEGY_SETTINGS", "LEGACY_DEFAULTS", "setting_names", "legacy_value",
    "MIN_TAU", "MAX_MU", "MAX_CLIP_RADIUS",
]

#: The smallest adaptivity ``tau`` of FedAdam, FedYogi and FedAdagrad: ``v`` starts at ``tau^2``, in float32
#: (whose normal numbers end near 1e-38), and a step ``m / (sqrt(v) + tau)`` is bounded by ``|m| / tau`` alone
#: once ``delta^2`` underflows. Its largest is 1: a ``tau`` above the deltas' size only divides the step.
MIN_TAU = 1e-10
#: The largest proximal weight ``mu`` of FedProx (Li et al. tune it from 0.001 to 1).
MAX_MU = 1e4
#: The largest clipping radius of centered clipping, an L2 norm of a model delta: far above any update's.
MAX_CLIP_RADIUS = 1e6


@dataclass(frozen=True)
class StrategySettings:
    """The settings of one strategy besides ``server_lr``: the base of every class of :data:`STRATEGY_SETTINGS`."""

    def _check(self) -> None:
        """Validate the keys (none here); a subclass with keys refuses a bad value, naming it."""


@dataclass(frozen=True)
class FedAvgSettings(StrategySettings):
    """``fedavg``: no settings besides ``server_lr``."""


@dataclass(frozen=True)
class FedProxSettings(StrategySettings):
    """``fedprox``: the clients' proximal term ``mu``."""

    mu: float = 0.01

    def _check(self) -> None:
        within("mu", self.mu, 0, MAX_MU)


@dataclass(frozen=True)
class FedAvgMSettings(StrategySettings):
    """``fedavgm``: the server momentum ``momentum`` (``beta``)."""

    momentum: float = 0.9

    def _check(self) -> None:
        fraction("momentum", self.momentum, allow_zero=True, allow_one=False)


@dataclass(frozen=True)
class FedAdamSettings(StrategySettings):
    """``fedadam``: the moments' decay rates ``beta1`` and ``beta2``, and the adaptivity ``tau``."""

    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def _check(self) -> None:
        fraction("beta1", self.beta1, allow_zero=True, allow_one=False)
        fraction("beta2", self.beta2, allow_zero=True, allow_one=False)
        within("tau", self.tau, MIN_TAU, 1)


@dataclass(frozen=True)
class FedYogiSettings(FedAdamSettings):
    """``fedyogi``: the keys of ``fedadam`` (``beta1``, ``beta2``, ``tau``)."""


@dataclass(frozen=True)
class FedAdagradSettings(StrategySettings):
    """``fedadagrad``: the first moment's decay rate ``beta1`` and the adaptivity ``tau``."""

    beta1: float = 0.9
    tau: float = 1e-3

    def _check(self) -> None:
        fraction("beta1", self.beta1, allow_zero=True, allow_one=False)
        within("tau", self.tau, MIN_TAU, 1)


@dataclass(frozen=True)
class ScaffoldSettings(StrategySettings):
    """``scaffold``: no settings besides ``server_lr`` (``eta_g``)."""


@dataclass(frozen=True)
class CenteredClippingSettings(StrategySettings):
    """``centered_clipping``: the clipping radius, the bucket size and the server momentum (the clipping centre)."""

    clip_radius: float = 1.0
    bucket_size: int = 2
    momentum: float = 0.9

    def _check(self) -> None:
        within("clip_radius", self.clip_radius, 0, MAX_CLIP_RADIUS, low_open=True)
        within("bucket_size", self.bucket_size, 1, MAX_CLIENTS)
        fraction("momentum", self.momentum, allow_zero=True, allow_one=False)


@dataclass(frozen=True)
class MedianSettings(StrategySettings):
    """``median``: no settings besides ``server_lr``."""


@dataclass(frozen=True)
class TrimmedMeanSettings(StrategySettings):
    """``trimmed_mean``: the fraction ``trim_fraction`` cut at each end (``beta``)."""

    trim_fraction: float = 0.2

    def _check(self) -> None:
        fraction("trim_fraction", self.trim_fraction, allow_zero=True, allow_one=False)
        if not self.trim_fraction < 0.5:
            raise Bad("trim_fraction", self.trim_fraction, "must be < 0.5 (a cut at each end)")


@dataclass(frozen=True)
class KrumSettings(StrategySettings):
    """``krum``: the Byzantine clients assumed (``f``) and the updates averaged (``m``: 1 is Krum, more Multi-Krum)."""

    num_byzantine: int = 0
    num_selected: int = 1

    def _check(self) -> None:
        within("num_byzantine", self.num_byzantine, 0, MAX_CLIENTS)
        within("num_selected", self.num_selected, 1, MAX_CLIENTS)


#: Each strategy's name (``[strategy] name``) -> the class of its settings (``[strategy.<name>]``).
STRATEGY_SETTINGS: dict[str, type[StrategySettings]] = {
    "fedavg": FedAvgSettings, "fedprox": FedProxSettings, "fedavgm": FedAvgMSettings,
    "fedadam": FedAdamSettings, "fedyogi": FedYogiSettings, "fedadagrad": FedAdagradSettings,
    "scaffold": ScaffoldSettings, "centered_clipping": CenteredClippingSettings, "median": MedianSettings,
    "trimmed_mean": TrimmedMeanSettings, "krum": KrumSettings,
}


def setting_names(name: str) -> tuple[str, ...]:
    """Return the keys of strategy ``name``'s settings, in their declared order."""
    return tuple(f.name for f in dataclasses.fields(STRATEGY_SETTINGS[name]))


def _every_key() -> tuple[dict[str, Any], type]:
    """Return every strategy's key with its default, and a dataclass of them all (without checks) to coerce one."""
    defaults: dict[str, Any] = {}
    hints: dict[str, Any] = {}
    for cls in STRATEGY_SETTINGS.values():
        types = typing.get_type_hints(cls)
        for spec in dataclasses.fields(cls):
            if defaults.setdefault(spec.name, spec.default) != spec.default:
                raise TypeError(f"two strategies give {spec.name} two defaults: a flat key could not be read")
            hints[spec.name] = types[spec.name]
    every = dataclasses.make_dataclass("EveryStrategyKey", [(k, hints[k], dataclasses.field(default=d))
                                                            for k, d in defaults.items()], frozen=True)
    return defaults, every


#: Every strategy's key -> its default (one per key across strategies): a flat ``[strategy]`` key of another
#: strategy than the chosen one is accepted at this value only (a run stored before the sub-tables holds them all).
LEGACY_DEFAULTS, _EVERY_KEY = _every_key()


def legacy_value(key: str, value: Any, prefix: str) -> Any:
    """Return ``value`` of the strategy key ``key`` coerced as its strategy reads it (``1`` -> ``1.0``).

    Raises
    ------
    Bad
        A value of the wrong type or out of range, naming ``prefix + key``.
    """
    return getattr(build(_EVERY_KEY, {key: value}, prefix), key)
