"""How much one client's update counts: its example count, bounded by a policy.

FedAvg weighs each update by the client's example count (McMahan et al.,
AISTATS 2017), a number the client reports itself: unbounded, one client that
claims ``num-examples = 10**12`` *is* the weighted mean. A
:class:`WeightPolicy` (the scenario's ``[federation] weighting``) bounds it:

``median`` (the default)
    ``min(n_i, median_cap * median(n))`` over the round's accepted replies: a
    client weighs at most ``median_cap`` times the round's median client, so
    it takes over only with a majority of colluding clients; honest federations
    whose counts stay within the cap aggregate exactly as FedAvg.
``capped``
    ``min(n_i, max_examples)``: a cap declared in advance.
``uniform``
    Every accepted update weighs 1 (the mean of the updates).

``capped`` and ``uniform`` know a weight the moment a reply arrives, so the
update folds into the running aggregate at once (memory O(model)). The
median is a property of the whole round: its weights are known once every
reply is in, so the train step keeps the round's decoded updates (zero-copy views
of the reply bytes) until then, O(replies x model); choose ``capped`` where
that matters. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["WeightPolicy", "Weighting"]

Weighting = Literal["median", "capped", "uniform"]


@dataclass(frozen=True)
class WeightPolicy:
    """A client weighting rule (see the module docstring).

    Attributes
    ----------
    kind : {"median", "capped", "uniform"}
        The rule.
    median_cap : float
        ``median``: a client weighs at most this many times the round's median count.
    max_examples : int
        ``capped``: a client weighs at most this many examples.
    """

    kind: Weighting = "median"
    median_cap: float = 3.0
    max_examples: int = 100_000

    @property
    def streams(self) -> bool:
        """Whether each weight is known when its reply arrives (no need for the round's other counts)."""
        return self.kind != "median"

    def weight(self, num_examples: int) -> float:
        """Return the weight of one reply under a streaming rule (``capped`` or ``uniform``)."""
        if self.kind == "uniform":
            return 1.0
        if self.kind == "capped":
            return float(min(num_examples, self.max_examples))
        raise ValueError("the median rule needs the whole round's counts: use weights()")

    def weights(self, counts: Sequence[int]) -> list[float]:
        """Return the weights of a whole round's accepted replies, in order."""
        if self.streams:
            return [self.weight(n) for n in counts]
        if not counts:
            return []
        cap = self.median_cap * float(np.median(np.asarray(counts, dtype=np.float64)))
        return [float(min(n, cap)) for n in counts]
