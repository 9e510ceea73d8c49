"""SCAFFOLD: stochastic controlled averaging.

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Algorithm 1 with option II.

The server keeps a control variate ``c`` beside the model ``x`` and sends both;
client ``i`` keeps its own ``c_i`` in its node state
(``learning.scaffold``), corrects every local gradient by ``c - c_i``, and
after ``K`` local steps of size ``lr`` from ``x`` to ``y_i`` answers with
``[y_i - x, c_i+ - c_i]`` in one vector, where
``c_i+ = c_i - c + (x - y_i) / (K lr)``. The server applies::

    x <- x + server_lr * mean_i(y_i - x)
    c <- c + |S| / N * mean_i(c_i+ - c_i)

over the ``|S|`` clients that answered of the federation's ``N``. The mean is
the round's weighted mean (``[federation] weighting``; ``"uniform"`` is the
paper's plain mean). Both control variates are kept and sent scaled by the
local learning rate (``lr * c``, in the units of one local step), so a
client's control delta is about a ``K``-th of its model delta and the bound on
an update's norm (``max_update_ratio``) covers it; the server never needs
``lr``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from core import aggregate
from core.aggregate import MeanState
from core.errors import UpdateRejected
from core.instructions import TrainConfig, with_control
from core.strategy import MeanStrategy, ServerState

__all__ = ["Scaffold", "CONTROL_SLOT"]

#: The server's control variate in :attr:`ServerState.slots` (checkpointed with the model).
CONTROL_SLOT = "c"


@dataclass(frozen=True)
class Scaffold(MeanStrategy):
    """SCAFFOLD's server side: ``x += server_lr * mean(dy)``, ``c += |S|/N * mean(dc)``.

    ``population`` is ``N``, the federation's clients; :meth:`for_round`
    binds the round's control variate, which :meth:`configure_train` sends.
    """

    server_lr: float = 1.0
    population: int = 1
    name: str = "scaffold"
    control: np.ndarray | None = field(default=None, compare=False, repr=False)

    def for_round(self, state: ServerState) -> Scaffold:
        """Return this strategy carrying the round's control variate (zeros before round 1)."""
        control = state.slots.get(CONTROL_SLOT)
        return replace(self, control=np.zeros_like(state.params) if control is None else control)

    def configure_train(self, config: TrainConfig) -> TrainConfig:
        """Send the server's control variate with the round's instruction."""
        if self.control is None:
            raise RuntimeError("SCAFFOLD sends the round's control variate: bind it with strategy.for_round(state)")
        return with_control(config, self.control)

    def new_aggregate(self, size: int) -> MeanState:
        """Return an empty running mean of ``[model delta, control delta]``: twice the model's size."""
        return aggregate.empty(2 * size)

    def finalize(self, agg: MeanState, rng: np.random.Generator) -> np.ndarray:  # noqa: ARG002 (Strategy's)
        """Return the mean of ``[dy, dc]`` with the count of updates behind it appended (``|S|``)."""
        return np.append(aggregate.finalize(agg), np.float32(agg.count)).astype(np.float32, copy=False)

    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """Step the model by ``server_lr * mean(dy)`` and the control variate by ``|S|/N * mean(dc)``.

        Raises
        ------
        UpdateRejected
            ``mean_delta`` is not ``2 x size + 1`` values long.
        """
        size = state.params.size
        if mean_delta.size != 2 * size + 1:
            raise UpdateRejected(f"SCAFFOLD's round mean has {mean_delta.size} values; expected 2 x {size} + 1")
        delta_y, delta_c, answered = mean_delta[:size], mean_delta[size:2 * size], float(mean_delta[-1])
        control = state.slots.get(CONTROL_SLOT)
        control = np.zeros_like(state.params) if control is None else control
        params = state.params + np.float32(self.server_lr) * delta_y
        control = control + np.float32(answered / self.population) * delta_c
        return state.advanced(params.astype(np.float32, copy=False), **{CONTROL_SLOT: control.astype(np.float32)})
