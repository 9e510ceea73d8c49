"""DP-FedAvg's noise mechanisms, by the name ``[dp] mechanism`` gives them: one registry.

A mechanism says where the clients' noise shares are added and where the
server's own noise comes from (all of it under the central placement; the
top-up for the shares of clients that dropped out under the distributed one).
:class:`privacy.dp.strategy.DPFedAvg` looks its ``mechanism`` up in
:data:`MECHANISMS`, which checks the settings it needs, once, when the
strategy is built.

``gaussian``
    Continuous Gaussian shares, added by each client in floats before secure
    aggregation quantises them; the server draws from the round's generator.
``discrete_gaussian``
    The distributed discrete Gaussian (:mod:`privacy.dp.discrete`), added by
    secure aggregation's encoder on its integer grid; the server's top-up
    comes from a cryptographic stream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from privacy.dp.discrete import CryptoStream
from privacy.dp.errors import DPConfigError
from privacy.dp.mechanisms import gaussian_noise

__all__ = ["NoiseMechanism", "Gaussian", "DiscreteGaussian", "MECHANISMS", "mechanism_named"]


@dataclass(frozen=True)
class NoiseMechanism(ABC):
    """One ``[dp] mechanism``: its name, where clients add their shares, and the server's draws."""

    name: str
    #: Whether the clients' shares are added by secure aggregation's encoder on its integer grid.
    on_grid: bool

    @abstractmethod
    def check(self, *, placement: str, adaptive: bool, noise_multiplier: float) -> None:
        """Refuse the settings this mechanism cannot work with, naming ``mechanism`` (:class:`DPConfigError`)."""

    @abstractmethod
    def server_noise(self, size: int, std: float, rng: np.random.Generator) -> np.ndarray:
        """Return ``size`` float32 draws of the server's noise with standard deviation ``std`` (zeros for 0)."""


@dataclass(frozen=True)
class Gaussian(NoiseMechanism):
    """Continuous Gaussian noise: any placement, fixed or adaptive clipping."""

    name: str = "gaussian"
    on_grid: bool = False

    def check(self, *, placement: str, adaptive: bool, noise_multiplier: float) -> None:
        """Accept every setting the strategy itself accepts."""
        del placement, adaptive, noise_multiplier

    def server_noise(self, size: int, std: float, rng: np.random.Generator) -> np.ndarray:
        """Draw from ``rng`` (a secure generator outside tests)."""
        return gaussian_noise(size, std, rng)


@dataclass(frozen=True)
class DiscreteGaussian(NoiseMechanism):
    """The distributed discrete Gaussian: the distributed placement, a fixed clip norm, a multiplier above 0."""

    name: str = "discrete_gaussian"
    on_grid: bool = True

    def check(self, *, placement: str, adaptive: bool, noise_multiplier: float) -> None:
        """Refuse the central placement, adaptive clipping and a noise multiplier of 0."""
        if placement != "distributed" or adaptive or not noise_multiplier > 0:
            raise DPConfigError("mechanism", self.name, "the discrete Gaussian needs the distributed placement, a "
                                "fixed clip norm and a noise multiplier above 0")

    def server_noise(self, size: int, std: float, rng: np.random.Generator) -> np.ndarray:
        """Draw the missing shares' variance from a cryptographic stream (from ``rng`` only when it is 0)."""
        if std > 0:
            return CryptoStream().normal(size, std).astype(np.float32)
        return gaussian_noise(size, std, rng)


#: ``[dp] mechanism`` -> the mechanism (the names of ``scenarios.threats.DPSpec.mechanism``).
MECHANISMS: dict[str, NoiseMechanism] = {m.name: m for m in (Gaussian(), DiscreteGaussian())}


def mechanism_named(name: str) -> NoiseMechanism:
    """Return the mechanism called ``name``.

    Raises
    ------
    DPConfigError
        No mechanism has that name; the message lists those that do.
    """
    found = MECHANISMS.get(name)
    if found is None:
        raise DPConfigError("mechanism", name, "must be one of " + ", ".join(repr(n) for n in MECHANISMS))
    return found
