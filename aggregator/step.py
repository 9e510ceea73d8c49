"""One round's server step, shared by every loop that runs rounds.

The federated :class:`~aggregator.rounds.RoundLoop` and the data-parallel
local-SGD mode (``runtimes.parallel.localsgd``) both build the round's
training instruction and turn a round's aggregate into the next server state
here, so the skip rule, the strategy's client settings and the server update
are written once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import numpy as np

from core.compress import Codec
from core.instructions import DOWNLINK_BITS, TrainConfig
from core.status import RoundStatus
from core.strategy import ServerState, Strategy, skips_short_rounds
from scenarios.schema import Scenario

__all__ = ["train_config", "round_codec", "advance"]


class Counted(Protocol):
    """A running aggregate that knows how many updates it folded (every strategy's does)."""

    @property
    def count(self) -> int:
        """Return the number of updates folded."""
        ...


C = TypeVar("C", bound=Counted)


def train_config(scenario: Scenario, strategy: Strategy[Any] | None, server_round: int) -> TrainConfig:
    """Build the round's training instruction.

    The scenario's settings, the round's compression (``[compression]``), then
    the strategy's own.

    ``strategy=None`` gives the plain settings (evaluation instructions carry
    no strategy settings, only the broadcast's precision).
    """
    t = scenario.training
    config = TrainConfig(round=server_round, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr,
                         momentum=t.momentum, seed=scenario.seed, steps=t.steps)
    down = scenario.compression.downlink_bits
    if strategy is None:  # an evaluation: the broadcast's precision only
        return config.with_settings({DOWNLINK_BITS: down}) if down != 32 else config
    codec = round_codec(scenario, server_round)
    settings = {**(codec.to_settings() if codec is not None else {}), **({DOWNLINK_BITS: down} if down != 32 else {})}
    return strategy.configure_train(config.with_settings(settings))


def round_codec(scenario: Scenario, server_round: int) -> Codec | None:
    """Return the uplink codec of ``server_round`` (``[compression]``), bound to the round's shared seed.

    ``None`` when updates travel dense.
    """
    spec = scenario.compression
    if not spec.uplink:
        return None
    seed = int(np.random.SeedSequence([scenario.seed, server_round, 0xC0DEC]).generate_state(1)[0])
    # under DP the decoded update is clipped or summed before the noise: rescaling it would scale the sensitivity
    return Codec(bits=spec.bits, topk=spec.topk, randomk=spec.randomk, error_feedback=spec.feedback, seed=seed,
                 rescale=not scenario.dp.enabled)


def advance(strategy: Strategy[C], state: ServerState, agg: C | None, *, min_clients: int,
            server_round: int, mean_of: Callable[[C], np.ndarray]) -> tuple[ServerState, str]:
    """Return the state after ``server_round`` and the round's status (``ok``, ``empty`` or ``skipped``).

    Fewer than ``min_clients`` usable updates leave the model as it was
    unless the strategy must account every round (DP). ``mean_of`` turns the
    aggregate into the mean update: ``strategy.finalize`` with the round's
    generator in one process; in the parallel mode, rank 0's finalize shared
    with every rank.
    """
    answered = agg.count if agg is not None else 0
    if answered < min_clients and skips_short_rounds(strategy):
        return replace(state, round=server_round), RoundStatus.SKIPPED
    if agg is None:
        agg = strategy.new_aggregate(state.params.size)
    new = strategy.apply(state, mean_of(agg))
    return replace(new, round=server_round), RoundStatus.OK if answered else RoundStatus.EMPTY
