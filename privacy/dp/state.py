"""The DP part of the server state: what checkpoint and resume must restore exactly.

It lives in ``ServerState.wrapper_state["dp"]`` as plain JSON data, so the run store
can commit it with the round and a resumed run continues with the same clip
norm and the same privacy spent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from privacy.dp.accountant import RoundEvent
from privacy.dp.errors import DPStateError

__all__ = ["DPState", "STATE_KEY", "STATE_VERSION"]

STATE_KEY = "dp"
STATE_VERSION = 1


@dataclass(frozen=True)
class DPState:
    """Accountant history, current clip norm and the last round's figures.

    Attributes
    ----------
    clip : float
        Clip norm for the next round (moves under adaptive clipping).
    history : tuple[RoundEvent, ...]
        Every accounted round, run-length encoded: (sampling, q, z, rounds).
    epsilon : float
        Epsilon spent so far at the run's delta (``inf`` without noise).
    below_fraction : float | None
        Last round's privatised fraction of clients under the clip norm
        (adaptive clipping only).
    server_history : tuple[RoundEvent, ...]
        What the aggregator itself saw (distributed placement): one unsampled
        Gaussian event per round with the noise of the clients who actually
        contributed, ``z sqrt(contributors / sampled)``; rounds nobody
        contributed to are absent (they showed the server nothing).
    """

    clip: float
    history: tuple[RoundEvent, ...] = ()
    epsilon: float = 0.0
    below_fraction: float | None = None
    server_history: tuple[RoundEvent, ...] = ()

    @property
    def rounds(self) -> int:
        """Rounds accounted so far."""
        return sum(e.rounds for e in self.history)

    def recorded(self, event: RoundEvent, *, clip: float, epsilon: float,
                 below_fraction: float | None, server_event: RoundEvent | None = None) -> DPState:
        """Return the state after one more accounted round ``event`` (and the server's view of it)."""
        server = self.server_history if server_event is None else _appended(self.server_history, server_event)
        return DPState(clip=clip, history=_appended(self.history, event), epsilon=epsilon,
                       below_fraction=below_fraction, server_history=server)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``ServerState.wrapper_state``; an infinite epsilon is written as ``None``."""
        return {"version": STATE_VERSION, "clip": self.clip,
                "history": [e.to_json() for e in self.history],
                "epsilon": self.epsilon if math.isfinite(self.epsilon) else None,
                "below_fraction": self.below_fraction,
                "server_history": [e.to_json() for e in self.server_history]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DPState:
        """Inverse of :meth:`to_json`.

        Raises
        ------
        DPStateError
            Unknown version or malformed content.
        """
        if not isinstance(data, Mapping) or data.get("version") != STATE_VERSION:
            raise DPStateError(f"DP state has an unknown layout: {data!r:.200}")
        try:
            eps = math.inf if data["epsilon"] is None else float(data["epsilon"])
            below = data.get("below_fraction")
            return cls(clip=float(data["clip"]),
                       history=tuple(RoundEvent.from_json(e) for e in data["history"]),
                       epsilon=eps, below_fraction=None if below is None else float(below),
                       server_history=tuple(RoundEvent.from_json(e) for e in data.get("server_history", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise DPStateError(f"unreadable DP state: {exc}") from None


def _appended(history: tuple[RoundEvent, ...], event: RoundEvent) -> tuple[RoundEvent, ...]:
    """``history`` with ``event`` added, run-length encoded (consecutive equal mechanisms merge)."""
    if history and history[-1].same_mechanism(event):
        return history[:-1] + (replace(history[-1], rounds=history[-1].rounds + event.rounds),)
    return history + (event,)
