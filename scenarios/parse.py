"""Turning plain data (parsed TOML) into frozen dataclasses, with errors that name the key.

The generic half of the scenario schema: type coercion by annotation
(``Literal`` choices matched by type as well as value, numbers bounded to 64-bit
and finite floats, booleans, strings, tables, nested sections), the value
checks sections call from their ``_check``, and the one-line rendering of a
bad key and value. ``scenarios.sections`` and ``scenarios.threats`` declare the
sections (``scenarios.schema`` assembles them into a scenario); a task declares
its own options with the same machinery (``scenarios.schema.build_options``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from core.envvars import show_number

__all__ = ["Bad", "build", "show_key", "show", "at_most", "at_least", "positive", "non_negative", "fraction", "within"]


class Bad(Exception):
    """Internal: a bad value, before the file and section are known."""

    def __init__(self, key: str, value: Any, why: str) -> None:
        super().__init__(key, value, why)
        self.key, self.value, self.why = key, value, why


def at_most(key: str, value: float, high: float) -> None:
    """Refuse ``value`` above ``high``, naming ``key``."""
    if not value <= high:
        raise Bad(key, value, f"must be <= {high:,}")


def at_least(key: str, value: float, low: float) -> None:
    """Refuse ``value`` below ``low``, naming ``key``."""
    if not value >= low:
        raise Bad(key, value, f"must be >= {low:g}")


def positive(key: str, value: float) -> None:
    """Refuse ``value`` unless it is above 0, naming ``key``."""
    if not value > 0:
        raise Bad(key, value, "must be > 0")


def non_negative(key: str, value: float) -> None:
    """Refuse a negative ``value``, naming ``key``."""
    if not value >= 0:
        raise Bad(key, value, "must be >= 0")


def fraction(key: str, value: float, *, allow_zero: bool = False, allow_one: bool = True) -> None:
    """Refuse ``value`` outside (0, 1], naming ``key``; ``allow_zero`` and ``allow_one`` open or close the ends."""
    within(key, value, 0, 1, low_open=not allow_zero, high_open=not allow_one)


def within(key: str, value: float, low: float, high: float, *, low_open: bool = False,
           high_open: bool = False, or_zero: bool = False) -> None:
    """Refuse ``value`` outside ``[low, high]``, naming ``key`` and the interval (``must be in (0, 1]``).

    ``low_open`` and ``high_open`` leave an end out; ``or_zero`` accepts 0
    as well (``must be 0 or in [2, 1,000,000]``: 0 picks a default or turns
    the setting off). NaN is outside every interval; so are a boolean and a
    value of a type that does not compare with numbers.

    Raises
    ------
    Bad
        ``value`` outside the interval.
    """
    try:
        inside = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    except TypeError:  # a string or a list where a number belongs (a field nothing coerced)
        inside = False
    if isinstance(value, bool) or not (inside or (or_zero and value == 0)):
        raise Bad(key, value, f"must be {'0 or ' if or_zero else ''}in {'(' if low_open else '['}{show_number(low)}, "
                              f"{show_number(high)}{')' if high_open else ']'}")


def show_key(key: str) -> str:
    """Show a key as written, or quoted when it holds a newline or another unprintable character."""
    return key if key.isprintable() else repr(key)


def show(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to one short line (a huge integer has no repr past 4300 digits)."""
    try:
        text = repr(value)
    except ValueError:
        text = f"<integer of about {value.bit_length() * 0.30103:.0f} digits>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build(cls: type, raw: Any, prefix: str, check: bool = True) -> Any:
    """Build the frozen dataclass ``cls`` from the table ``raw``, then run its ``_check`` (unless ``check`` is off).

    Each value is coerced by its field's annotation; errors name the key under
    ``prefix`` (``"training."``). ``check=False`` keeps the names and types
    checked and skips ``cls._check``: what a task's options say of the world
    (a data folder that exists) is not asked of a model served elsewhere.

    Raises
    ------
    Bad
        A value that is not a table, an unknown or missing key, or a bad value.
    """
    if not isinstance(raw, Mapping):
        raise Bad(prefix.rstrip(".") or "<root>", raw, "must be a table")
    hints = typing.get_type_hints(cls)
    keys: dict[str, str] = getattr(cls, "TOML_KEYS", {})  # field name -> the key a file writes
    names = {keys.get(f.name, f.name): f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise Bad(prefix + unknown[0], raw[unknown[0]], f"unknown key; allowed: {', '.join(sorted(names))}")
    values = {}
    for key in set(names) & set(raw):
        values[names[key]] = _coerce(hints[names[key]], raw[key], prefix + key)
    try:
        obj = cls(**values)
    except TypeError as exc:  # a required key is missing
        raise Bad(prefix.rstrip(".") or "<root>", None, str(exc)) from None
    checker = getattr(obj, "_check", None) if check else None
    if checker is not None:
        try:
            checker()
        except Bad as bad:
            raise Bad(prefix + bad.key, bad.value, bad.why) from None
    return obj


def _coerce(hint: Any, value: Any, key: str) -> Any:
    from_table = getattr(hint, "from_table", None)
    if from_table is not None:  # a section that builds itself (``[task]`` keeps unknown keys for the task)
        return from_table(value, key)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, key + ".")
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        # by type as well: 32.0 == 32, but bits = 32.0 is not one of the choices
        if not any(type(value) is type(a) and value == a for a in args):
            raise Bad(key, value, f"must be one of {', '.join(repr(a) for a in args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        # a table picks the dataclass member of the union (byzantine = 0.2 | { ... })
        tables = [a for a in inner if dataclasses.is_dataclass(a)]
        if tables and (isinstance(value, Mapping) or dataclasses.is_dataclass(value)):
            return _coerce(tables[0], value, key)
        plain = [a for a in inner if not dataclasses.is_dataclass(a)] or inner
        return None if value is None else _coerce(plain[0], value, key)
    if origin in (Mapping, dict) or hint is Mapping:
        if not isinstance(value, Mapping):
            raise Bad(key, value, "must be a table")
        return dict(value)
    return _scalar(hint, value, key)


def _scalar(hint: Any, value: Any, key: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise Bad(key, value, "must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Bad(key, value, "must be an integer")
        if not -(2**63) <= value < 2**63:
            raise Bad(key, value, "is out of range (a 64-bit integer)")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Bad(key, value, "must be a number")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond ~1.8e308
            raise Bad(key, value, "is out of range (too large for a float)") from None
        if number != number or number in (float("inf"), float("-inf")):
            raise Bad(key, value, "must be a finite number")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise Bad(key, value, "must be a string")
        return value
    raise Bad(key, value, f"unsupported type {hint}")  # pragma: no cover - schema bug
