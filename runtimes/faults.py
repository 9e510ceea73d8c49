"""Faults injected at the in-process transport: vanishing, late and corrupt clients.

Every decision is a pure function of the scenario seed, the round, the stage
and the node, so a rerun (or a resumed run) injects exactly the same faults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, Message

from scenarios.threats import CORRUPTIONS, FaultSpec

__all__ = ["FaultPlan", "stage_of"]

_STAGE_CODES = {"train": 1, "advertise_keys": 2, "share_keys": 3, "masked_input": 4, "unmask": 5,
                "consistency_check": 6}


def stage_of(message: Message) -> str:
    """Return the protocol stage a message belongs to: a secagg stage, or its type."""
    content = message.content if message.has_content() else None
    if content is not None and "secagg" in content.config_records:
        return str(content.config_records["secagg"].get("stage", "train"))
    return message.metadata.message_type.split(".")[0]


def _round_of(message: Message) -> int:
    try:
        return int(message.metadata.group_id)
    except ValueError:
        return 0


@dataclass(frozen=True)
class FaultPlan:
    """Which clients vanish at which stage, straggle, or send corrupt updates."""

    seed: int = 0
    dropouts: Mapping[str, float] = field(default_factory=dict)
    stragglers: float = 0.0
    straggler_delay_s: float = 0.0
    byzantine: float = 0.0
    byzantine_kind: str = "nan"
    edges: float = 0.0  # the fraction of a round's edge aggregators that vanish ([faults] edges)
    #: (round, stage) -> the nodes that vanish, decided over a whole cohort ahead of its batches (expect_cohort)
    cohorts: dict[tuple[int, str], frozenset[int]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def none(cls) -> FaultPlan:
        """Return a plan with no faults."""
        return cls()

    @classmethod
    def from_spec(cls, spec: FaultSpec, seed: int) -> FaultPlan:
        """Return the plan for a scenario's ``[faults]``: dropouts, stragglers and corrupt replies only."""
        # Only corrupt replies are a transport fault; attacks with valid updates
        # are forged by the ClientApp (clients.attacks), on every runtime.
        byzantine = spec.byzantine_spec
        corrupt = byzantine.attack in CORRUPTIONS
        return cls(seed=seed, dropouts=dict(spec.dropouts), stragglers=spec.stragglers,
                   straggler_delay_s=spec.straggler_delay_s, byzantine=byzantine.fraction if corrupt else 0.0,
                   byzantine_kind=byzantine.attack if corrupt else "nan", edges=spec.edges)

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *key])

    def pick_dropped(self, batch: Sequence[Message]) -> set[int]:
        """Ids (``id(message)``) of exactly ``round(fraction * n)`` messages per stage.

        ``n`` is the batch's messages of that round and stage, or the cohort
        given to :meth:`expect_cohort` for it, whose vanishing nodes were
        decided then, whatever batches its messages come in.
        """
        if not any(self.dropouts.values()):
            return set()
        groups: dict[tuple[int, str], list[Message]] = {}
        for message in batch:
            groups.setdefault((_round_of(message), stage_of(message)), []).append(message)
        dropped: set[int] = set()
        for key, messages in groups.items():
            planned = self.cohorts.get(key)
            if planned is None:
                planned = self._vanishing(*key, [m.metadata.dst_node_id for m in messages])
            dropped.update(id(m) for m in messages if m.metadata.dst_node_id in planned)
        return dropped

    def expect_cohort(self, server_round: int, stage: str, nodes: Sequence[int]) -> None:
        """Decide now which of ``nodes`` vanish at ``stage`` of ``server_round``: those one batch of them would lose.

        For a round whose messages are pushed in several batches (each edge
        aggregator pushes its own devices' in simulation): the same nodes
        vanish as when one batch carries them all, as in a flat run.
        """
        self.cohorts[(server_round, stage)] = self._vanishing(server_round, stage, nodes)

    def lost_edges(self, server_round: int, edges: Sequence[int]) -> frozenset[int]:
        """Return which of a round's ``edges`` vanish after their devices trained: exactly ``round(fraction * n)``."""
        count = int(round(self.edges * len(edges)))
        if not count:
            return frozenset()
        order = sorted(edges)
        return frozenset(order[i] for i in self._rng(server_round, 0xED).choice(len(order), count, replace=False))

    def _vanishing(self, server_round: int, stage: str, nodes: Sequence[int]) -> frozenset[int]:
        count = int(round(self.dropouts.get(stage, 0.0) * len(nodes)))
        if not count:
            return frozenset()
        order = sorted(nodes)
        picks = self._rng(server_round, _STAGE_CODES.get(stage, 9)).choice(len(order), count, replace=False)
        return frozenset(order[i] for i in picks)

    def _chosen(self, message: Message, fraction: float, code: int) -> bool:
        if fraction <= 0:
            return False
        return bool(self._rng(_round_of(message), message.metadata.dst_node_id, code).random() < fraction)

    def delay_for(self, message: Message) -> float:
        """Seconds a straggler's reply is held back (0 for punctual nodes)."""
        return self.straggler_delay_s if self._chosen(message, self.stragglers, 101) else 0.0

    def corrupt(self, message: Message, reply: Message) -> Message:
        """Return a Byzantine node's train reply with its update replaced by garbage (else ``reply`` itself)."""
        if self.byzantine <= 0 or reply.has_error() or stage_of(message) != "train" \
                or not self._chosen(message, self.byzantine, 202):
            return reply
        records = reply.content.array_records
        if "update" not in records:
            return reply
        delta = records["update"]["delta"].numpy()
        records["update"] = ArrayRecord({"delta": _corrupted(delta, self.byzantine_kind)})
        return reply


def _corrupted(delta: np.ndarray, kind: str) -> Array:
    if kind == "nan":
        bad = delta.copy()
        bad[:: max(1, bad.size // 10)] = np.nan
        return Array(bad)
    if kind == "wrong_shape":
        return Array(delta[: max(1, delta.size // 2)].copy())
    if kind == "oversized":
        return Array(np.zeros(delta.size * 64, dtype=np.float32))
    return Array(dtype="float32", shape=tuple(delta.shape), stype="numpy.ndarray", data=b"\x00garbage")
