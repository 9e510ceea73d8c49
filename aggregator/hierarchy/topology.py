"""Which edge aggregator each device is under."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """``edges`` edge aggregators over the devices ``devices``: contiguous blocks in device order.

    Device ``i`` of ``N`` (by sorted id) is under edge ``i * edges // N``, so
    every edge has ``N // edges`` or one more devices, as devices enrolled
    with their site's edge would be.
    """

    edges: int
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        """Refuse no edge, more edges than devices, or a device twice."""
        if not 0 < self.edges <= len(self.devices):
            raise ValueError(f"{self.edges} edges need between 1 and {len(self.devices)} (the devices) edges")
        if any(a >= b for a, b in zip(self.devices, self.devices[1:], strict=False)):
            raise ValueError("devices must be distinct, in increasing order (Topology.blocks sorts them)")

    @classmethod
    def blocks(cls, edges: int, devices: Iterable[int]) -> Topology:
        """Split ``devices`` (sorted by id) over ``edges`` edges."""
        return cls(edges, tuple(sorted(devices)))

    def edge_of(self, device: int) -> int:
        """Return the edge ``device`` is under.

        Raises
        ------
        KeyError
            ``device`` is under no edge.
        """
        i = bisect.bisect_left(self.devices, device)
        if i == len(self.devices) or self.devices[i] != device:
            raise KeyError(device)
        return i * self.edges // len(self.devices)

    def groups(self, sampled: Sequence[int]) -> list[tuple[int, list[int]]]:
        """Group the sampled devices by edge: ``(edge, its devices in the order given)``, edges in order.

        Edges with no sampled device are left out: they have nothing to do this round.
        """
        by_edge: dict[int, list[int]] = {}
        for device in sampled:
            by_edge.setdefault(self.edge_of(device), []).append(device)
        return sorted(by_edge.items())

    def members(self, edge: int) -> list[int]:
        """Return the devices under ``edge``."""
        n = len(self.devices)
        return [d for i, d in enumerate(self.devices) if i * self.edges // n == edge]
