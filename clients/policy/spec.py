"""``policy.toml``: a device's site policy, parsed once into a frozen, validated dataclass.

Every key is optional and a missing file is no policy::

    require_secure_aggregation = true    # only rounds under secure aggregation
    max_epsilon = 8.0                    # the run's client-level DP budget at most this (no DP: refused)
    min_cohort = 5                       # at least this many clients in the round
    allowed_tasks = ["<sha256 hex>"]     # only these tasks (the SHA-256 of the file defining the task class)
    max_rounds_per_day = 24              # at most this many rounds trained in any 24 hours

An unknown key, a value of the wrong type, NaN, a negative or huge number or
a digest that is not 64 hex digits is a :class:`~clients.policy.errors.PolicyError`
in one line naming the file, the key and the value: a policy is never half read.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.policy.errors import PolicyError
from scenarios.bounds import MAX_CLIENTS

__all__ = ["SitePolicy", "parse_policy", "load_policy", "KEYS", "MAX_EPSILON", "MAX_ROUNDS_PER_DAY", "MAX_TASKS",
           "MAX_POLICY_BYTES"]

#: The keys a policy may hold, in the order the rules are checked.
KEYS = ("require_secure_aggregation", "max_epsilon", "min_cohort", "allowed_tasks", "max_rounds_per_day")
#: A scenario's ``target_epsilon`` bound: past 1,000 a guarantee bounds nothing.
MAX_EPSILON = 1000.0
#: Rounds in a day: one every second is already far beyond any federation's pace.
MAX_ROUNDS_PER_DAY = 86_400
#: Tasks one policy may list.
MAX_TASKS = 10_000
#: The largest policy file read.
MAX_POLICY_BYTES = 64 * 1024
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class SitePolicy:
    """What a device accepts; ``None`` (or ``False``) for a rule means the key was not given."""

    require_secure_aggregation: bool = False
    max_epsilon: float | None = None
    min_cohort: int | None = None
    allowed_tasks: frozenset[str] | None = None  # lower-case SHA-256 hex digests
    max_rounds_per_day: int | None = None

    def is_empty(self) -> bool:
        """Whether no rule is set (an empty file)."""
        return self == SitePolicy()

    def describe(self) -> str:
        """One line for the device's console: ``require_secure_aggregation, min_cohort = 5``, or ``no rule``."""
        tasks = None if self.allowed_tasks is None else f"allowed_tasks ({len(self.allowed_tasks)} listed)"
        parts = ["require_secure_aggregation" if self.require_secure_aggregation else None,
                 None if self.max_epsilon is None else f"max_epsilon = {self.max_epsilon:g}",
                 None if self.min_cohort is None else f"min_cohort = {self.min_cohort}", tasks,
                 None if self.max_rounds_per_day is None else f"max_rounds_per_day = {self.max_rounds_per_day}"]
        return ", ".join(p for p in parts if p) or "no rule"


def load_policy(path: Path) -> SitePolicy:
    """Read and check the policy file at ``path``.

    Raises
    ------
    PolicyError
        The file cannot be read, is over :data:`MAX_POLICY_BYTES`, is not
        UTF-8 TOML, or a key or value is refused (named, with the file).
    """
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_POLICY_BYTES + 1)
    except OSError as exc:
        raise PolicyError(f"{path}: cannot read the site policy ({exc.strerror or type(exc).__name__})") from None
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(f"{path}: over {MAX_POLICY_BYTES} bytes: not a site policy")
    try:
        raw = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise PolicyError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{path}: not valid TOML: {' '.join(str(exc).split())}") from None
    return parse_policy(raw, str(path))


def parse_policy(raw: Mapping[Any, Any], source: str = "policy.toml") -> SitePolicy:
    """Check parsed TOML (``raw``) key by key and return the policy.

    Raises
    ------
    PolicyError
        An unknown key, or a value refused by its key's check, named with ``source``.
    """
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        raise PolicyError(f"{source}: unknown key {_shown(unknown[0])} (the keys are {', '.join(KEYS)})")
    tasks = raw.get("allowed_tasks")
    return SitePolicy(
        require_secure_aggregation=_flag(raw, "require_secure_aggregation", source),
        max_epsilon=_epsilon(raw.get("max_epsilon"), source),
        min_cohort=_count(raw, "min_cohort", MAX_CLIENTS, source),
        allowed_tasks=None if tasks is None else _tasks(tasks, source),
        max_rounds_per_day=_count(raw, "max_rounds_per_day", MAX_ROUNDS_PER_DAY, source),
    )


def _bad(source: str, key: str, value: object, why: str) -> PolicyError:
    return PolicyError(f"{source}: {key} = {_shown(value)}: {why}")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _flag(raw: Mapping[Any, Any], key: str, source: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise _bad(source, key, value, "must be true or false")
    return value


def _epsilon(value: object, source: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer beyond float's range
        number = math.inf
    if not (math.isfinite(number) and 0 < number <= MAX_EPSILON):
        raise _bad(source, "max_epsilon", value, f"must be a number in (0, {MAX_EPSILON:g}]")
    return number


def _count(raw: Mapping[Any, Any], key: str, high: int, source: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise _bad(source, key, value, f"must be a whole number from 1 to {high:,}")
    return value


def _tasks(value: object, source: str) -> frozenset[str]:
    if not isinstance(value, list):
        raise _bad(source, "allowed_tasks", value, "must be a list of SHA-256 digests (64 hex digits each)")
    if len(value) > MAX_TASKS:
        raise _bad(source, "allowed_tasks", f"<{len(value)} entries>", f"at most {MAX_TASKS:,} tasks")
    for i, digest in enumerate(value):
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise _bad(source, f"allowed_tasks[{i}]", digest, "not a SHA-256 digest (64 hex digits)")
    return frozenset(d.lower() for d in value)
