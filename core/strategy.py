"""The strategy interface: a handful of methods, state in and new state out.

A strategy decides how client updates are weighted and folded (through the
aggregation core's monoid) and how the server applies the mean update to the
global model (its server optimiser). The round loop in
``aggregator.rounds`` is the single owner of the loop; strategies hold no
loop logic and no mutable state of their own: everything that changes between
rounds lives in :class:`ServerState`, which the run store checkpoints.

Privacy is added by composition: a DP strategy wraps another strategy and
overrides ``accumulate`` / ``finalize`` (see ``privacy.dp``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from core import aggregate
from core.instructions import TrainConfig

__all__ = ["AggregateState", "ServerState", "Strategy"]

#: A strategy's running aggregate, opaque to the round loop: an :class:`core.aggregate.MeanState`
#: for the sum-decomposable rules, the strategy's own state otherwise (``core.buffer.UpdateBuffer``,
#: centered clipping's bucketed state), so subclasses narrow it in their signatures.
AggregateState = Any


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
    extra : Mapping[str, Any]
        Small JSON-able state of wrappers (e.g. a DP accountant, a clip norm).
    """

    params: np.ndarray
    slots: Mapping[str, np.ndarray] = field(default_factory=dict)
    round: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def advanced(self, params: np.ndarray, **slots: np.ndarray) -> ServerState:
        """Return the state after one more round with new params and slots."""
        return replace(self, params=params, slots={**self.slots, **slots}, round=self.round + 1)


class Strategy(ABC):
    """Base class of server strategies (FedAvg by default behaviour)."""

    name: str = "strategy"
    #: Whether a round with fewer than ``min_clients`` usable updates leaves the
    #: model and state untouched. DP strategies must account every round.
    skip_when_short: bool = True
    #: Whether :meth:`private_term` is not the delta itself but a term centred elsewhere (centered
    #: clipping): a central DP wrapper then must not have clients clip their raw deltas first.
    centres_private_terms: bool = False

    def for_round(self, state: ServerState) -> Strategy:  # noqa: ARG002 (a default; overrides use it)
        """Return this strategy with per-round settings taken from ``state`` bound."""
        return self

    def with_cohort(self, sampled: int) -> Strategy:  # noqa: ARG002 (a default; overrides use it)
        """Return this round's strategy told how many clients :meth:`sample` drew.

        A DP strategy sizes each client's noise share by it; the loop calls it
        after sampling, before configuring.
        """
        return self

    def sample(self, node_ids: Sequence[int], k: int, seed: int, server_round: int) -> list[int]:
        """Choose this round's clients: ``k`` of ``node_ids``, a pure function of (seed, round)."""
        ordered = sorted(node_ids)
        k = min(k, len(ordered))
        picks = np.random.default_rng([seed, server_round, 0x5A]).choice(len(ordered), size=k, replace=False)
        return sorted(ordered[i] for i in picks)

    def round_rng(self, seed: int, server_round: int) -> np.random.Generator:
        """Return the generator ``finalize`` draws from (seeded: reproducible runs)."""
        return np.random.default_rng([seed, server_round, 0xD9])

    def init_state(self, params: np.ndarray) -> ServerState:
        """Return the state before round 1 for initial global ``params``."""
        return ServerState(params=params.astype(np.float32, copy=True))

    def configure_train(self, config: TrainConfig) -> TrainConfig:
        """Return the round's training instruction with this strategy's client settings added.

        The round loop builds ``config`` from the scenario; a strategy that
        needs something of the clients (FedProx's proximal term, DP's clipping)
        returns a copy carrying it, so no loop knows any strategy's keys.
        """
        return config

    def new_aggregate(self, size: int) -> AggregateState:
        """Return an empty running aggregate for a model of ``size`` parameters."""
        return aggregate.empty(size)

    def accumulate(self, agg: AggregateState, update: np.ndarray, num_examples: float, *,
                   checked: bool = False) -> AggregateState:
        """Fold one client's update (a delta), weighted by its example count.

        ``checked=True``: the update was already scanned for NaN/Inf (decoded by
        :func:`core.replies.decode_flat`), so it is not scanned again.
        """
        return aggregate.add(agg, update, float(num_examples), checked=checked)

    def merge(self, agg: AggregateState, partial: AggregateState) -> AggregateState:
        """Fold a partial aggregate summed elsewhere (secure aggregation's sum, another worker's state).

        A wrapper that checks what reaches the server overrides this as well as
        :meth:`accumulate`, so its checks run whichever way the updates arrive.
        """
        return aggregate.merge(agg, partial)

    def finalize(self, agg: AggregateState, rng: np.random.Generator) -> np.ndarray:  # noqa: ARG002 (a default; overrides use it)
        """Turn the running aggregate into the mean update (a delta)."""
        return aggregate.finalize(agg)

    def private_term(self, update: np.ndarray) -> np.ndarray:
        """Return what a client-level DP wrapper clips, sums and noises for one client's delta.

        The delta itself for the FedAvg family. A robust rule whose per-client
        influence is a bounded term of a sum (centered clipping) returns that
        term, so the DP wrapper's noise covers the rule's own release; see
        :meth:`from_private_mean`.
        """
        return update

    def from_private_mean(self, mean_term: np.ndarray) -> np.ndarray:
        """Return what :meth:`apply` takes, from the DP wrapper's noised mean of :meth:`private_term` values.

        Post-processing: it may use only what earlier rounds released.
        """
        return mean_term

    @abstractmethod
    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """Apply the mean client delta to the global model (server optimiser)."""

    def describe(self) -> dict[str, Any]:
        """Return the settings worth recording with the run."""
        return {"name": self.name}

    def epsilon(self, state: ServerState) -> float | None:  # noqa: ARG002 (a default; overrides use it)
        """Privacy spent up to ``state``; ``None`` for a strategy that makes no privacy claim."""
        return None

    def would_exceed_budget(self, state: ServerState) -> bool:  # noqa: ARG002 (a default; overrides use it)
        """Whether one more round would overspend a privacy budget (never, without one)."""
        return False

    def round_metrics(self, state: ServerState) -> dict[str, float]:  # noqa: ARG002 (a default; overrides use it)
        """Figures to record with the round that led to ``state`` (e.g. DP's server-view epsilon)."""
        return {}
