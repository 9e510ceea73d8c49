"""A task's headline metric: its name, which way is better, and its value in a stored round.

A task declares the one figure it is judged by (``headline_metric = ("c_index",
"up")``; ``accuracy`` up when it declares none); the run keeps the declaration
in its ``info`` so every reader (the CLI, the dashboard, ``/metrics``, the
report) shows that figure first without importing the task. A round stores a
task's scores in two places: ``accuracy`` and ``loss`` in columns of their own
(``server_*``, ``fed_*``), every other name in the round's metrics as
``server-<name>`` (the aggregator's held-out set) or ``fed-<name>`` (the
example-weighted mean over the clients' test splits). :func:`round_scores`
gathers them back by split, in the task's own names.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Headline", "ACCURACY", "UP", "DOWN", "SPLITS", "parse_headline", "headline_of", "round_scores",
           "round_value", "format_value"]

UP, DOWN = "up", "down"
#: Where a round's scores were taken, best first: the aggregator's held-out set, then the clients' test splits.
SPLITS = (("server", "server", "server-"), ("federated", "fed", "fed-"))
#: Names whose smaller values are better, when a task names its headline without a direction.
_LOWER_IS_BETTER = frozenset({"loss", "mae", "mse", "rmse", "mape", "perplexity", "error", "error_rate",
                              "logloss", "log_loss", "brier", "wer", "cer"})
#: Round metrics with a split's prefix that are no task's score (DP's server-view epsilon).
_NOT_SCORES = frozenset({"server-epsilon"})
_MAX_NAME = 64


@dataclass(frozen=True)
class Headline:
    """The metric a run is judged by, and whether higher (``up``) or lower (``down``) is better."""

    name: str = "accuracy"
    direction: str = UP

    @property
    def higher_is_better(self) -> bool:
        """Whether a higher value is better (direction ``up``)."""
        return self.direction == UP

    def best(self, values: Iterable[float | None]) -> float | None:
        """Return the best of ``values`` (``None`` and non-finite ones left out; ``None`` when none is left)."""
        known = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not known:
            return None
        return max(known) if self.higher_is_better else min(known)

    def to_json(self) -> dict[str, str]:
        """Return the headline as a run's ``info`` records it: its name and direction."""
        return {"name": self.name, "direction": self.direction}

    @classmethod
    def from_info(cls, info: Mapping[str, Any] | None) -> Headline:
        """Return the headline a run recorded in its ``info`` (``accuracy`` up for a run stored before it did)."""
        recorded = (info or {}).get("headline")
        if not isinstance(recorded, Mapping):
            return ACCURACY
        try:
            return parse_headline((recorded.get("name"), recorded.get("direction")))
        except ValueError:
            return ACCURACY


ACCURACY = Headline()


def parse_headline(declared: Any) -> Headline:
    """Parse a declaration as a task writes it: ``"c_index"`` or ``("c_index", "up")``.

    A bare name takes ``down`` for the names of errors and losses (``mae``,
    ``rmse``, ``perplexity``, ...) and ``up`` otherwise.

    Raises
    ------
    ValueError
        Naming the value: not a non-empty name of at most 64 characters, or a
        direction other than ``up`` / ``down``.
    """
    name, direction = (declared[0], declared[1]) if isinstance(declared, (tuple, list)) and len(declared) == 2 \
        else (declared, None)
    if not isinstance(name, str) or not name.strip() or len(name) > _MAX_NAME:
        raise ValueError(f"headline_metric = {declared!r}: expected a metric name (at most {_MAX_NAME} characters) "
                         "or a (name, 'up' | 'down') pair")
    if direction is None:
        direction = DOWN if name.lower() in _LOWER_IS_BETTER or name.lower().endswith("loss") else UP
    if direction not in (UP, DOWN):
        raise ValueError(f"headline_metric = {declared!r}: the direction must be 'up' (higher is better) or "
                         "'down' (lower is better)")
    return Headline(name, direction)


def headline_of(task: Any) -> Headline:
    """Return the headline a task (a class or an instance) declares with ``headline_metric``.

    ``accuracy`` up without one.

    Raises
    ------
    ValueError
        The declaration is malformed (:func:`parse_headline`).
    """
    declared = getattr(task, "headline_metric", None)
    return ACCURACY if declared is None else parse_headline(declared)


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def round_scores(row: Any) -> dict[str, dict[str, float]]:
    """Return a round's task scores by split (``server``, ``federated``), each in the task's own names.

    ``row`` is anything with the round's columns (a :class:`core.records.RoundRecord`,
    a stored round): ``server_accuracy``, ``server_loss``, ``fed_accuracy``,
    ``fed_loss`` and ``metrics``. A split without any score is left out.
    """
    metrics = getattr(row, "metrics", None) or {}
    scores: dict[str, dict[str, float]] = {}
    for split, column, prefix in SPLITS:
        named: dict[str, Any] = {"accuracy": getattr(row, f"{column}_accuracy", None)}
        named.update({k[len(prefix):]: v for k, v in metrics.items()
                      if isinstance(k, str) and k.startswith(prefix) and k not in _NOT_SCORES})
        named["loss"] = getattr(row, f"{column}_loss", None)
        values = {k: v for k, v in ((k, _finite(v)) for k, v in named.items()) if v is not None}
        if values:
            scores[split] = values
    return scores


def round_value(headline: Headline, row: Any) -> tuple[float | None, str | None]:
    """Return the headline's value in a round and its split (the server's first); ``(None, None)`` if absent."""
    for split, values in round_scores(row).items():
        if headline.name in values:
            return values[headline.name], split
    return None, None


def format_value(name: str, value: float | None, missing: str = "-") -> str:
    """Format a score as a person reads it: ``accuracy`` as a percentage, others to four significant digits.

    The digits are kept, trailing zeros included (``0.7300``, not ``0.73``: a
    score of 0.73 is known to four digits too), without a bare trailing point
    (``1000``).
    """
    if value is None or not math.isfinite(value):
        return missing
    if name == "accuracy":
        return f"{value:.2%}"
    text = f"{value:#.4g}"
    return text if "e" in text else text.rstrip(".")
