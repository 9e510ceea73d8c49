"""The rounds a device trained, counted by the device itself for ``max_rounds_per_day``.

A small JSON file in the agent's folder (``.quorum-agent/policy-rounds.json``)
holds the times of the rounds this device accepted to train in the last 24
hours, by its own clock: nothing the aggregator says is counted. A file that
cannot be read is a :class:`~clients.policy.errors.PolicyError` (the device
then refuses the rounds the rule governs until its owner mends or deletes it);
it is written whole, through a temporary file, so a crash never leaves half of one.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from clients.policy.errors import PolicyError
from clients.policy.spec import MAX_ROUNDS_PER_DAY

__all__ = ["RoundLedger", "DAY_S"]

#: The window ``max_rounds_per_day`` counts over, in seconds.
DAY_S = 86_400.0
_MAX_BYTES = 64 * (MAX_ROUNDS_PER_DAY + 16)  # every time a day may hold, with room
_LOCK = threading.Lock()  # one read-modify-write at a time in a process (a device's worker serves one task at once)


class RoundLedger:
    """The times this device accepted a training round, in the last :data:`DAY_S` seconds.

    Parameters
    ----------
    path : Path
        The file (created on the first round).
    clock : Callable[[], float]
        Unix time; injected by tests.
    """

    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path, self.clock = path, clock

    def count(self) -> int:
        """Return how many rounds were trained in the last 24 hours.

        Raises
        ------
        PolicyError
            The file cannot be read or is not a round count.
        """
        with _LOCK:
            return len(self._recent(self.clock()))

    def record(self) -> int:
        """Count a round trained now; return the count after it.

        Raises
        ------
        PolicyError
            The file cannot be read or written.
        """
        with _LOCK:
            now = self.clock()
            times = [*self._recent(now), now]
            self._write(times)
            return len(times)

    def _recent(self, now: float) -> list[float]:
        """Return the recorded times after ``now - DAY_S`` (one ahead of the clock, set back since, still counts)."""
        return [t for t in self._read() if t > now - DAY_S]

    def _read(self) -> list[float]:
        try:
            with self.path.open("rb") as handle:
                data = handle.read(_MAX_BYTES + 1)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise PolicyError(f"{self.path}: cannot read the round count ({exc.strerror or type(exc).__name__})") \
                from None
        try:
            if len(data) > _MAX_BYTES:
                raise ValueError("too large")
            times = json.loads(data.decode("utf-8"))["trained"]
            if not isinstance(times, list) or not all(_finite(t) for t in times):
                raise ValueError("not a list of times")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise PolicyError(f"{self.path}: not a round count ({exc}); delete it to start counting again") from None
        return [float(t) for t in times]

    def _write(self, times: list[float]) -> None:
        scratch = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch.write_text(json.dumps({"trained": times[-MAX_ROUNDS_PER_DAY:]}), encoding="utf-8")
            os.replace(scratch, self.path)
        except OSError as exc:
            raise PolicyError(f"{self.path}: cannot write the round count ({exc.strerror or type(exc).__name__})") \
                from None


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
