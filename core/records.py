"""What one round leaves behind: the round and client records the store commits.

The round loop, the train workflows and every runtime build these; the run store
persists them. They live in ``core`` because both the server side and the
runtimes speak them, and the store is only one of their readers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ClientRecord", "RoundRecord"]


@dataclass(frozen=True, slots=True)
class ClientRecord:
    """One client's part in one round, as the round loop saw it (slotted: a round may hold 100,000)."""

    client: str
    outcome: str  # ok | dropped | rejected | failed | refused | late (core/outcomes.py; "error" in older stores)
    num_examples: int = 0
    train_loss: float | None = None
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    duration_s: float | None = None
    bytes_in: int = 0  # uplink: the client's replies, serialised as on Flower's wire
    bytes_out: int = 0  # downlink: the instructions sent to it
    stage: str | None = None
    reason: str | None = None
    metrics: dict[str, Any] | None = None
    edge: int | None = None  # under [hierarchy]: the edge aggregator it trained under (stored with its metrics)


@dataclass(frozen=True)
class RoundRecord:
    """Everything committed for one round."""

    round: int
    started_at: float
    duration_s: float
    sampled: int
    clients: Sequence[ClientRecord]
    train_loss: float | None = None
    fed_loss: float | None = None
    fed_accuracy: float | None = None
    server_loss: float | None = None
    server_accuracy: float | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    epsilon: float | None = None
    secagg: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    tree: dict[str, Any] | None = None  # under [hierarchy]: each edge's devices, outcomes, time and bytes

    def count(self, outcome: str) -> int:
        """Count the round's clients whose outcome is ``outcome``."""
        return sum(1 for c in self.clients if c.outcome == outcome)
