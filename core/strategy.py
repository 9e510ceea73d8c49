"""The strategy interface: six methods, state in and new state out, generic in the aggregate.

A strategy decides how client updates are weighted and folded (through the
aggregation core's monoid) and how the server applies the mean update to the
global model (its server optimiser). The round loop in
``aggregator.rounds`` is the single owner of the loop; strategies hold no
loop logic and no mutable state of their own: everything that changes between
rounds lives in :class:`ServerState`, which the run store checkpoints.

:class:`Strategy` has the six methods every strategy needs. Its type parameter
is its running aggregate: a :class:`core.aggregate.MeanState` for the
sum-decomposable rules (:class:`MeanStrategy`), the rule's own state for the
robust ones (``core.buffer.UpdateBuffer``, centered clipping's buckets).

Privacy is added by composition: a DP strategy wraps another strategy and adds
the hooks of :class:`PrivateStrategy` (a secret sample, secret noise, the
accountant, the budget). The loops reach those hooks only through the
functions at the end of this module, which give a plain round's behaviour for
every other strategy, so no loop and no plain strategy knows DP's methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Generic, Self, TypeVar

import numpy as np

from core import aggregate
from core.aggregate import MeanState
from core.instructions import TrainConfig

__all__ = ["ServerState", "Strategy", "MeanStrategy", "PrivateStrategy", "describe", "initial_state",
           "sample_clients", "round_rng", "bind_cohort", "fold_secure_sum", "skips_short_rounds", "epsilon",
           "would_exceed_budget", "round_metrics"]

#: A strategy's running aggregate type.
A = TypeVar("A")


@dataclass(frozen=True)
class ServerState:
    """Everything the server carries from one round to the next.

    Attributes
    ----------
    params : np.ndarray
        The global model as one flat float32 buffer.
    slots : Mapping[str, np.ndarray]
        Server-optimiser state (momentum, second moments), each as large as
        ``params``; checkpointed with the model.
    round : int
        The number of rounds applied so far.
    wrapper_state : Mapping[str, Any]
        Small JSON-able state of wrappers and loops, by owner: DP's accountant and clip norm
        (``"dp"``), FedBuff's virtual clock (``"async"``). Checkpointed with the model.
    """

    params: np.ndarray
    slots: Mapping[str, np.ndarray] = field(default_factory=dict)
    round: int = 0
    wrapper_state: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def initial(cls, params: np.ndarray) -> ServerState:
        """Return the state before round 1: a float32 copy of ``params``, no slots, nothing spent."""
        return cls(params=params.astype(np.float32, copy=True))

    def advanced(self, params: np.ndarray, **slots: np.ndarray) -> ServerState:
        """Return the state after one more round with new params and slots."""
        return replace(self, params=params, slots={**self.slots, **slots}, round=self.round + 1)


class Strategy(ABC, Generic[A]):
    """Base class of server strategies: six methods, generic in the running aggregate ``A``.

    ``for_round`` and ``configure_train`` have defaults (nothing to bind, no
    client settings); the other four are each strategy's own.
    """

    name: str = "strategy"

    def for_round(self, state: ServerState) -> Self:  # noqa: ARG002 (a default; overrides use it)
        """Return this strategy with per-round settings taken from ``state`` bound."""
        return self

    def configure_train(self, config: TrainConfig) -> TrainConfig:
        """Return the round's training instruction with this strategy's client settings added.

        The round loop builds ``config`` from the scenario; a strategy that
        needs something of the clients (FedProx's proximal term, DP's clipping)
        returns a copy carrying it, so no loop knows any strategy's keys.
        """
        return config

    @abstractmethod
    def new_aggregate(self, size: int) -> A:
        """Return an empty running aggregate for a model of ``size`` parameters."""

    @abstractmethod
    def accumulate(self, agg: A, update: np.ndarray, num_examples: float, *, checked: bool = False) -> A:
        """Fold one client's update (a delta), weighted by its example count.

        ``checked=True``: the update was already scanned for NaN/Inf (decoded by
        :func:`core.replies.decode_flat`), so it is not scanned again.
        """

    @abstractmethod
    def finalize(self, agg: A, rng: np.random.Generator) -> np.ndarray:
        """Turn the running aggregate into the mean update (a delta); ``rng`` for a rule that draws."""

    @abstractmethod
    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """Apply the mean client delta to the global model (server optimiser)."""


class MeanStrategy(Strategy[MeanState]):
    """The FedAvg family: a weighted running mean (:mod:`core.aggregate`); only :meth:`apply` is left."""

    def new_aggregate(self, size: int) -> MeanState:
        """Return an empty running mean for a model of ``size`` parameters."""
        return aggregate.empty(size)

    def accumulate(self, agg: MeanState, update: np.ndarray, num_examples: float, *,
                   checked: bool = False) -> MeanState:
        """Fold one client's update, weighted by its example count."""
        return aggregate.add(agg, update, float(num_examples), checked=checked)

    def finalize(self, agg: MeanState, rng: np.random.Generator) -> np.ndarray:  # noqa: ARG002 (Strategy's)
        """Return the weighted mean of the folded updates."""
        return aggregate.finalize(agg)


class PrivateStrategy(Strategy[A]):
    """The hooks a privacy wrapper owns beside the six methods (``privacy.dp.DPFedAvg`` implements them).

    The loops call them through this module's functions (:func:`sample_clients`,
    :func:`round_rng`, :func:`bind_cohort`, ...), which give every other
    strategy a plain round's behaviour.
    """

    @abstractmethod
    def sample(self, node_ids: Sequence[int], k: int) -> list[int]:
        """Choose this round's clients from a generator nobody can predict."""

    @abstractmethod
    def noise_rng(self) -> np.random.Generator:
        """Return the generator :meth:`finalize` draws its noise from (never a known seed)."""

    @abstractmethod
    def with_cohort(self, sampled: int) -> Self:
        """Return this round's strategy told how many clients :meth:`sample` drew."""

    @abstractmethod
    def fold_sum(self, agg: A, partial: MeanState) -> A:
        """Fold a securely summed partial aggregate, with the checks the server can still make on a sum."""

    @abstractmethod
    def fresh_state(self, params: np.ndarray) -> ServerState:
        """Return the state before the first round this strategy accounts, for initial ``params``."""

    @abstractmethod
    def epsilon(self, state: ServerState) -> float:
        """Privacy spent up to ``state``."""

    @abstractmethod
    def would_exceed_budget(self, state: ServerState) -> bool:
        """Whether one more round would overspend the privacy budget."""

    @abstractmethod
    def round_metrics(self, state: ServerState) -> dict[str, float]:
        """Figures to record with the round that led to ``state``."""

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """Return the settings worth recording with the run (what :func:`describe` gives)."""


# ------------------------------------------------------------ what the loops call


def describe(strategy: Strategy[Any]) -> dict[str, Any]:
    """Return the settings worth recording with the run.

    A dataclass strategy's name and its fields shown in its ``repr`` (a bound
    per-round value is not); a private strategy's own :meth:`PrivateStrategy.settings`.
    """
    if isinstance(strategy, PrivateStrategy):
        return strategy.settings()
    out: dict[str, Any] = {"name": strategy.name}
    if is_dataclass(strategy):
        out.update({f.name: getattr(strategy, f.name) for f in fields(strategy) if f.repr and f.name != "name"})
    return out


def initial_state(strategy: Strategy[Any], params: np.ndarray) -> ServerState:
    """Return the state before the first round ``strategy`` runs from ``params`` (a private one's spend at 0)."""
    if isinstance(strategy, PrivateStrategy):
        return strategy.fresh_state(params)
    return ServerState.initial(params)


def sample_clients(strategy: Strategy[Any], node_ids: Sequence[int], k: int, seed: int,
                   server_round: int) -> list[int]:
    """Choose this round's clients: ``k`` of ``node_ids``, a pure function of (seed, round).

    A private strategy draws its own secret sample instead.
    """
    if isinstance(strategy, PrivateStrategy):
        return strategy.sample(node_ids, k)
    ordered = sorted(node_ids)
    k = min(k, len(ordered))
    picks = np.random.default_rng([seed, server_round, 0x5A]).choice(len(ordered), size=k, replace=False)
    return sorted(ordered[i] for i in picks)


def round_rng(strategy: Strategy[Any], seed: int, server_round: int) -> np.random.Generator:
    """Return the generator ``finalize`` draws from: seeded (reproducible runs), a private strategy's own otherwise."""
    if isinstance(strategy, PrivateStrategy):
        return strategy.noise_rng()
    return np.random.default_rng([seed, server_round, 0xD9])


def bind_cohort(strategy: Strategy[A], sampled: int) -> Strategy[A]:
    """Return the round's strategy told that ``sampled`` clients were drawn (it sizes DP's noise shares)."""
    return strategy.with_cohort(sampled) if isinstance(strategy, PrivateStrategy) else strategy


def fold_secure_sum(strategy: Strategy[Any], size: int, partial: MeanState) -> Any:
    """Return the round's aggregate from a securely summed ``partial`` (the sum itself, for a plain strategy).

    A plain strategy's aggregate keeps the partial's precision (float64 under ``[federation] accumulate``).

    Raises
    ------
    TypeError
        ``strategy`` folds no running mean (a robust rule: it must see every update).
    """
    if isinstance(strategy, PrivateStrategy):
        return strategy.fold_sum(strategy.new_aggregate(size), partial)
    empty = strategy.new_aggregate(size)
    if not isinstance(empty, MeanState):
        raise TypeError(f"strategy {strategy.name!r} needs every update; a secure sum hides them")
    return aggregate.merge(aggregate.widened(empty, partial.total.dtype.name), partial)


def skips_short_rounds(strategy: Strategy[Any]) -> bool:
    """Whether a round with fewer than ``min_clients`` usable updates leaves the model and state untouched.

    Not for a private strategy: every round is accounted, even a short one.
    """
    return not isinstance(strategy, PrivateStrategy)


def epsilon(strategy: Strategy[Any], state: ServerState) -> float | None:
    """Privacy spent up to ``state``; ``None`` for a strategy that makes no privacy claim."""
    return strategy.epsilon(state) if isinstance(strategy, PrivateStrategy) else None


def would_exceed_budget(strategy: Strategy[Any], state: ServerState) -> bool:
    """Whether one more round would overspend a privacy budget (never, without one)."""
    return strategy.would_exceed_budget(state) if isinstance(strategy, PrivateStrategy) else False


def round_metrics(strategy: Strategy[Any], state: ServerState) -> dict[str, float]:
    """Figures to record with the round that led to ``state`` (e.g. DP's server-view epsilon)."""
    return strategy.round_metrics(state) if isinstance(strategy, PrivateStrategy) else {}
