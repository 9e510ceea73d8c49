"""Privacy accounting with Google's ``dp-accounting`` RDP accountant.

Each DP-FedAvg round is one sampled Gaussian mechanism: clients are sampled,
their clipped updates summed and Gaussian noise of std ``z * C`` added. The
accountant composes rounds in Renyi DP (Mironov, "Renyi Differential
Privacy", CSF 2017; Mironov, Talwar and Zhang, "Renyi Differential Privacy
of the Sampled Gaussian Mechanism", 2019) and converts to (epsilon, delta)
with the library's improved conversion (Balle et al., "Hypothesis Testing
Interpretations and Renyi Differential Privacy", AISTATS 2020).

Two sampling schemes, each with the adjacency it is analysed under:

``poisson``
    every client joins a round independently with probability ``q``; add or
    remove one client; the sum's sensitivity is ``C``, so the noise
    multiplier is ``z``.
``fixed``
    exactly ``m`` of ``N`` clients, uniformly without replacement; the
    library supports this only under replace-one adjacency (Wang, Balle and
    Kasiviswanathan, "Subsampled Renyi Differential Privacy and Analytical
    Moments Accountant", AISTATS 2019, Theorem 27), where replacing one
    client's clipped update moves the sum by up to ``2C``: the noise
    multiplier handed to the accountant is therefore ``z / 2``.

The RDP curve of one round is computed once per distinct round (cached) and
composed by the library's rule (RDP adds up over rounds).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from privacy.dp.errors import DPConfigError, DPStateError

if TYPE_CHECKING:  # imported where used: the library costs about 1.2 s, which a run without DP never pays
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

__all__ = ["Sampling", "RoundEvent", "epsilon_of", "plan_epsilon", "noise_for_epsilon", "fixed_pair"]

Sampling = Literal["poisson", "fixed"]
SAMPLINGS: tuple[str, ...] = ("poisson", "fixed")


@dataclass(frozen=True)
class RoundEvent:
    """``rounds`` consecutive DP-FedAvg rounds with the same sampling and noise.

    Attributes
    ----------
    sampling : {"poisson", "fixed"}
        How clients were sampled.
    sample : int
        Clients per round: expected (Poisson) or exact (fixed).
    population : int
        Clients that could be sampled.
    noise_multiplier : float
        Noise std over clip norm, ``z`` (the effective one under adaptive clipping).
    rounds : int
        How many rounds this entry stands for.
    """

    sampling: Sampling
    sample: int
    population: int
    noise_multiplier: float
    rounds: int = 1

    def __post_init__(self) -> None:
        """Refuse an unknown sampling, a sample outside ``[1, population]``, a negative ``z`` or round count."""
        _check_sampling(self.sampling)
        if not 0 < self.sample <= self.population:
            raise DPConfigError("expected_clients", self.sample, f"must be in [1, population = {self.population}]")
        _check_non_negative("noise_multiplier", self.noise_multiplier)
        if self.rounds < 0:
            raise DPConfigError("rounds", self.rounds, "must be >= 0")

    @property
    def rate(self) -> float:
        """Sampling rate ``q = sample / population``."""
        return self.sample / self.population

    def same_mechanism(self, other: RoundEvent) -> bool:
        """Whether ``other`` differs from this entry only in its round count."""
        return (self.sampling, self.sample, self.population, self.noise_multiplier) == (
            other.sampling, other.sample, other.population, other.noise_multiplier)

    def to_json(self) -> dict[str, Any]:
        """Return the entry as the DP state stores it (``z`` for the noise multiplier)."""
        return {"sampling": self.sampling, "sample": self.sample, "population": self.population,
                "z": self.noise_multiplier, "rounds": self.rounds}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundEvent:
        """Read an entry :meth:`to_json` wrote.

        Raises
        ------
        DPStateError
            A key is missing or a value unreadable.
        """
        try:
            return cls(cast(Sampling, str(data["sampling"])), int(data["sample"]), int(data["population"]),
                       float(data["z"]), int(data["rounds"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise DPStateError(f"unreadable accountant entry {dict(data)!r}: {exc}") from None


def epsilon_of(events: Sequence[RoundEvent], delta: float) -> float:
    """Epsilon at ``delta`` after composing ``events`` (0 for none, inf without noise).

    Raises
    ------
    DPStateError
        When the events mix sampling schemes (their adjacencies differ).
    """
    _check_delta(delta)
    events = [e for e in events if e.rounds > 0]
    if not events:
        return 0.0
    if len({e.sampling for e in events}) > 1:
        raise DPStateError("accountant history mixes poisson and fixed sampling")
    if any(e.noise_multiplier == 0 for e in events):
        return math.inf
    total = sum(e.rounds * _round_rdp(e.sampling, e.sample, e.population, e.noise_multiplier)
                for e in events)
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    with _quiet_library():
        eps, _ = rdp_lib.compute_epsilon(rdp_lib.DEFAULT_RDP_ORDERS, total, delta)
    return float(eps)


def plan_epsilon(rate: float, rounds: int, noise: float, delta: float, sampling: Sampling = "poisson") -> float:
    """Epsilon that ``rounds`` DP-FedAvg rounds will spend, for planning a run.

    Parameters
    ----------
    rate : float
        Clients per round over population, ``q`` in (0, 1].
    rounds : int
        Number of rounds ``T``.
    noise : float
        Noise multiplier ``z`` (std of the noise on the sum over the clip norm).
    delta : float
        Target delta, in (0, 1); commonly below ``1 / population``.
    sampling : {"poisson", "fixed"}
        Client sampling scheme (see the module docstring for the adjacency).

    Returns
    -------
    float
        Epsilon from the RDP accountant; ``inf`` when ``noise`` is 0.

    Examples
    --------
    McMahan et al. (ICLR 2018)'s setting is one call away; with q = 0.1,
    T = 100, z = 1, delta = 1e-5 and Poisson sampling this gives 7.90.
    """
    sample, population = fixed_pair(rate)
    _check_rounds(rounds)
    return epsilon_of([RoundEvent(sampling, sample, population, float(noise), rounds)], delta)


def noise_for_epsilon(
    target_epsilon: float, rate: float, rounds: int, delta: float, sampling: Sampling = "poisson",
    *, rel_tol: float = 1e-4,
) -> float:
    """Smallest noise multiplier ``z`` whose ``rounds`` rounds stay within ``target_epsilon``.

    Uses the library's calibration search (Brent's method over ``z``,
    ``dp_accounting.calibrate_dp_mechanism``) on a bracket found by doubling;
    the result satisfies ``plan_epsilon(rate, rounds, z, delta) <= target_epsilon``
    and is within ``rel_tol`` (relative) of the exact answer.
    """
    _check_positive("target_epsilon", target_epsilon)
    _check_rounds(rounds)
    sample, population = fixed_pair(rate)
    if rounds == 0:
        return 0.0

    def eps(z: float) -> float:
        return epsilon_of([RoundEvent(sampling, sample, population, z, rounds)], delta)

    low, high = _bracket(eps, target_epsilon)
    import dp_accounting

    with _quiet_library():
        z = dp_accounting.calibrate_dp_mechanism(
            lambda: _accountant(sampling),
            lambda z: _event(sampling, sample, population, z, rounds),
            target_epsilon, delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(low, high),
            tol=rel_tol * low)
    return float(z)


def fixed_pair(rate: float) -> tuple[int, int]:
    """``(sample, population)`` integers whose ratio is ``rate`` (to 1e-9)."""
    if isinstance(rate, bool) or not 0 < rate <= 1:
        raise DPConfigError("rate", rate, "must be in (0, 1]")
    frac = Fraction(rate).limit_denominator(10**9)
    return frac.numerator, frac.denominator


def _bracket(eps: Any, target: float) -> tuple[float, float]:
    """``(low, high)`` with ``eps(low) > target >= eps(high)``, ``high = 2 * low``."""
    high = 1.0
    while eps(high) > target:
        high *= 2.0
        if high > 1e6:
            raise DPConfigError("target_epsilon", target, "is out of reach for any noise multiplier")
    low = high / 2.0
    while eps(low) <= target:
        high, low = low, low / 2.0
    return low, high


@functools.lru_cache(maxsize=256)
def _round_rdp(sampling: str, sample: int, population: int, z: float) -> np.ndarray:
    """RDP curve (at the library's default orders) of one round, from the library."""
    accountant = _accountant(sampling)
    with _quiet_library():
        accountant.compose(_event(sampling, sample, population, z, 1))
    curve: np.ndarray = accountant.rdp
    curve.setflags(write=False)
    return curve


def _accountant(sampling: str) -> rdp_lib.RdpAccountant:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

    relation = dp_accounting.NeighboringRelation
    if sampling == "poisson":
        return rdp_lib.RdpAccountant(neighboring_relation=relation.ADD_OR_REMOVE_ONE)
    return rdp_lib.RdpAccountant(neighboring_relation=relation.REPLACE_ONE)


def _event(sampling: str, sample: int, population: int, z: float, rounds: int) -> dp_accounting.DpEvent:
    import dp_accounting

    if sampling == "poisson":
        one = dp_accounting.PoissonSampledDpEvent(sample / population, dp_accounting.GaussianDpEvent(z))
    else:  # replace-one: the clipped sum moves by up to 2C, so the multiplier is z / 2
        one = dp_accounting.SampledWithoutReplacementDpEvent(
            population, sample, dp_accounting.GaussianDpEvent(z / 2.0))
    return dp_accounting.SelfComposedDpEvent(one, rounds)


class _DropNonConvergence(logging.Filter):
    """Drop ``dp-accounting``'s warnings that a fractional RDP order's series does not converge.

    The library then drops that order, which is safe (the bound only gets
    looser); the warning would otherwise flood the run log every round.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _quiet_library() -> Iterator[None]:
    logger, quiet = logging.getLogger("absl"), _DropNonConvergence()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _check_sampling(sampling: str) -> None:
    if sampling not in SAMPLINGS:
        raise DPConfigError("sampling", sampling, f"must be one of {', '.join(SAMPLINGS)}")


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise DPConfigError("delta", delta, "must be in (0, 1)")


def _check_rounds(rounds: int) -> None:
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise DPConfigError("rounds", rounds, "must be an integer >= 0")


def _check_positive(key: str, value: float) -> None:
    if not value > 0 or not math.isfinite(value):
        raise DPConfigError(key, value, "must be a positive number")


def _check_non_negative(key: str, value: float) -> None:
    if not value >= 0 or not math.isfinite(value):
        raise DPConfigError(key, value, "must be a finite number >= 0")
