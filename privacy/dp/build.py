"""``make_dp_strategy``: DP-FedAvg built from a scenario's ``[dp]`` table."""

from __future__ import annotations

from typing import Any

from core.strategy import Strategy
from privacy.dp import adaptive as adapt
from privacy.dp.accountant import noise_for_epsilon
from privacy.dp.errors import DPConfigError
from privacy.dp.strategy import DPFedAvg
from scenarios.threats import DPSpec

__all__ = ["make_dp_strategy"]


def make_dp_strategy(
    inner: Strategy[Any], spec: DPSpec, *, clients_per_round: int, population: int, rounds: int
) -> DPFedAvg:
    """Build :class:`DPFedAvg` from a scenario's ``[dp]`` table.

    When ``spec.noise_multiplier`` is unset, ``z`` is derived before the run
    as the smallest value that keeps ``rounds`` rounds within
    ``spec.target_epsilon`` (:func:`privacy.dp.noise_for_epsilon`).

    Raises
    ------
    DPConfigError
        DP disabled, or settings that cannot work together; names the key.
    """
    if not spec.enabled:
        raise DPConfigError("enabled", spec.enabled, "make_dp_strategy needs dp.enabled = true")
    z = spec.noise_multiplier
    if z is None:
        if spec.target_epsilon is None:
            raise DPConfigError("noise_multiplier", None, "give noise_multiplier, or target_epsilon to derive it")
        z = noise_for_epsilon(spec.target_epsilon, clients_per_round / population, rounds, spec.delta, spec.sampling)
    adaptive = None
    if spec.adaptive_clipping:
        adaptive = adapt.AdaptiveClipConfig(spec.target_quantile, spec.clip_lr, spec.count_noise_multiplier)
    return DPFedAvg(inner, clip_norm=spec.clip_norm, noise_multiplier=z, expected_clients=clients_per_round,
                    population=population, delta=spec.delta, sampling=spec.sampling, placement=spec.placement,
                    adaptive=adaptive, target_epsilon=spec.target_epsilon, mechanism=spec.mechanism)
