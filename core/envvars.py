"""Numbers read from environment variables, each checked against a range from its meaning.

Every number Quorum takes from the environment (``QUORUM_LEASE_S``, the rank
and world size ``torchrun`` sets) goes through :func:`env_number`: a value
that is not a number, not finite, or outside its range stops the command
before it starts, in one line naming the variable, its value and the range,
instead of an ``OverflowError`` or ``ValueError`` in whatever thread first
uses it.
"""

from __future__ import annotations

import math
import os
from typing import TypeVar

from core.errors import QuorumError

__all__ = ["env_number", "show_number"]

N = TypeVar("N", int, float)


def env_number(name: str, default: N | None, low: N, high: N, *, means: str, unit: str = "",
               error: type[Exception] = QuorumError) -> N:
    """Return the environment variable ``name`` as a number in ``[low, high]``; ``default`` when unset or blank.

    The type of ``low`` decides the parse: an ``int`` bound reads a whole
    number (``int("3")``), a ``float`` bound any finite number.

    Parameters
    ----------
    name : str
        The variable (``QUORUM_LEASE_S``).
    default : int | float | None
        The value when the variable is unset or blank; ``None``: it must be set.
    low, high : int | float
        The range, both ends included.
    means : str
        What the number is, for the message (``"the run lease"``).
    unit : str
        What it counts, for the message (``"seconds"``).
    error : type[Exception]
        The error raised: one of the caller's package (``StoreError``).

    Raises
    ------
    Exception
        ``error``, with one line naming the variable, the value and the range:
        ``QUORUM_LEASE_S='1e308': the run lease must be a number of seconds in
        [0.1, 604,800] (default 30)``.
    """
    raw = os.environ.get(name, "").strip()
    if not raw and default is not None:
        return default
    value = _parse(raw, whole=isinstance(low, int))
    if value is None or not low <= value <= high:
        kind = ("a whole number" if isinstance(low, int) else "a number") + (f" of {unit}" if unit else "")
        told = f" (default {show_number(default)})" if default is not None else ""
        raise error(f"{name}={raw!r}: {means} must be {kind} in [{show_number(low)}, {show_number(high)}]{told}")
    return type(low)(value)


def _parse(raw: str, *, whole: bool) -> float | None:
    """``raw`` as a finite number (a whole one when ``whole``), else None."""
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:  # not a number, or an integer of more than 4,300 digits
        return None
    return value if math.isfinite(value) else None


def show_number(number: float) -> str:
    """Show a bound or a default: a whole number with thousands separators (``604,800``), else ``0.1``, ``1e-10``."""
    if float(number).is_integer() and abs(number) < 1e15:
        return f"{int(number):,}"
    return f"{number:g}"
