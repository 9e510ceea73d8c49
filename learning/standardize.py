"""Federated feature standardisation: every feature scaled to zero mean and unit variance, from sums alone.

``[data] standardize = "federated"`` runs three statistics passes before
round 1. In each, a client answers a train instruction marked
:data:`core.instructions.STD_PASS` not with a model update but with a vector about its
training rows, weighted by its row count; the round's train workflow folds
these like updates, so under ``[secagg]`` the server learns only their
weighted sum, and without it the same checks as for an update apply:

1. ``flags``: for each feature and each candidate scale ``S`` of
   :data:`SCALES`, whether the client's mean or root mean square exceeds
   ``limit x S`` (1 or 0). The sum tells the server, per feature, the
   weighted share of clients over each scale, and it picks each feature's
   smallest scale ``S_j`` that no client exceeds. No client's values are
   ever clipped, so no later difference of sums isolates one client.
2. ``means``: ``mean_j / S_j``; the server gets each feature's mean.
3. ``spread``: ``E[(x_j - mean_j)^2] / (2 S_j)^2`` around the global mean
   (at most ``limit``): the variance without the cancellation of
   ``E[x^2] - E[x]^2``.

``std_j`` at or below :data:`STD_FLOOR` x ``S_j`` (a feature constant on
every device) is taken as 1: the feature is centred, not rescaled. Every
later train and evaluate instruction carries the mean and std
(:meth:`Standardization.to_settings`); clients standardise their rows with them
before the task sees the data, and the aggregator its own held-out set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from core.instructions import STD_MEAN, STD_PASS, STD_STD, Setting, SettingValue, TrainConfig

__all__ = ["SCALES", "STD_FLOOR", "PASSES",
           "INFO_KEY", "asks_for_statistics", "feature_rows", "statistics_vector", "choose_scales",
           "Standardization", "standardized", "StandardizeInputs"]

#: The statistics passes, in order (the values of :data:`core.instructions.STD_PASS`).
PASSES = ("flags", "means", "spread")
#: The scales a feature may take: values up to about 1, 256, 65,536, 1.7e7, 4.3e9 and 1.1e12.
SCALES = tuple(2.0**k for k in (0, 8, 16, 24, 32, 40))
#: A feature whose std is at most this x its scale counts as constant: it is centred but not rescaled.
STD_FLOOR = 1e-6
#: The run's ``info`` key holding its standardisation (``quorum export`` puts it in front of the model).
INFO_KEY = "standardization"


def asks_for_statistics(content: Any) -> bool:
    """Whether a train instruction's records (a Flower ``RecordDict``) ask for a pass, not training."""
    settings = content.config_records.get("config")
    return settings is not None and f"x.{STD_PASS.key}" in settings


def feature_rows(x: np.ndarray) -> np.ndarray:
    """Return the examples as rows of features (an image's pixels are its features), in float64."""
    return np.asarray(x, dtype=np.float64).reshape(x.shape[0], -1)


def statistics_vector(x: np.ndarray, kind: str, limit: float, scales: Any = None, mean: Any = None) -> np.ndarray:
    """Return what one client sends in pass ``kind`` about its rows ``x`` (module docstring); float32.

    Raises
    ------
    ValueError
        No rows, non-finite rows, an unknown pass, or scales / a mean that do not fit the rows.
    """
    if x.shape[0] == 0:
        raise ValueError("no training rows to take statistics of")
    rows = feature_rows(x)
    if not np.isfinite(rows).all():
        raise ValueError("the training rows hold NaN or Inf values")
    if kind == "flags":
        with np.errstate(over="ignore"):  # a value near 1e300 squares to inf: over every scale, as it should be
            size = np.maximum(np.abs(rows.mean(axis=0)), np.sqrt((rows**2).mean(axis=0)))
        return np.concatenate([(size > limit * s) for s in SCALES]).astype(np.float32)
    per_feature = _per_feature(scales, rows.shape[1], "scales")
    if not np.isin(per_feature, SCALES).all():
        raise ValueError(f"the pass's scales must be among {', '.join(f'{s:g}' for s in SCALES)}")
    if kind == "means":
        values = rows.mean(axis=0) / per_feature
    elif kind == "spread":
        centre = _per_feature(mean, rows.shape[1], "mean", positive=False)
        if (np.abs(centre) > per_feature).any():  # a pooled mean lies within its feature's scale
            raise ValueError("the pass's mean lies outside its features' scales")
        values = ((rows - centre) ** 2).mean(axis=0) / (2 * per_feature) ** 2
    else:
        raise ValueError(f"unknown statistics pass {kind!r} (expected one of {', '.join(PASSES)})")
    clipped: np.ndarray = np.clip(values, -limit, limit)
    return clipped.astype(np.float32)


def _per_feature(values: Any, features: int, what: str, positive: bool = True) -> np.ndarray:
    """Untrusted per-feature values from an instruction, checked."""
    try:
        found = np.asarray(values if values is not None else [], dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        found = np.empty(0)
    if found.shape != (features,) or not np.isfinite(found).all() or (positive and not (found > 0).all()):
        raise ValueError(f"the pass's {what} must be {features} finite{' positive' if positive else ''} values")
    return found


def choose_scales(flag_shares: np.ndarray, features: int) -> np.ndarray:
    """Each feature's smallest scale that no client exceeds, from the flags pass's weighted mean.

    Raises
    ------
    ValueError
        A feature beyond the largest scale on some client (named).
    """
    shares = np.asarray(flag_shares, dtype=np.float64).reshape(len(SCALES), features)
    fits = shares <= 1e-9  # an honest 0 sums to exactly 0, also on the secure-aggregation grid
    if not fits[-1].all():
        bad = np.flatnonzero(~fits[-1])[:5].tolist()
        raise ValueError(f"feature(s) {bad} exceed {SCALES[-1]:.3g} on some device: not a feature to standardise")
    chosen: np.ndarray = np.asarray(SCALES)[fits.argmax(axis=0)]
    return chosen


@dataclass(frozen=True)
class Standardization:
    """Per-feature mean and std (float32, one value per feature)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def from_passes(cls, means: np.ndarray, spread: np.ndarray, scales: np.ndarray) -> Standardization:
        """From the ``means`` and ``spread`` passes' weighted means at the features' ``scales``."""
        m, v, s = (np.asarray(a, dtype=np.float64) for a in (means, spread, scales))
        if not (m.shape == v.shape == s.shape and m.ndim == 1) or not np.isfinite(np.stack([m, v])).all():
            raise ValueError(f"statistics of shapes {m.shape}, {v.shape}, {s.shape}: expected equal, finite")
        std = np.sqrt(np.maximum(v, 0.0)) * 2 * s
        std = np.where(std <= STD_FLOOR * s, 1.0, std)  # constant on every device: centred, not rescaled
        return cls((m * s).astype(np.float32), std.astype(np.float32))

    def to_settings(self) -> dict[Setting[Any], SettingValue]:
        """Return the mean and std as an instruction carries them (lists of floats)."""
        return {STD_MEAN: [float(v) for v in self.mean], STD_STD: [float(v) for v in self.std]}

    @classmethod
    def from_config(cls, config: TrainConfig) -> Standardization | None:
        """Return the standardisation an instruction carries, or ``None``; a malformed one is a ``ValueError``."""
        std = config.get(STD_STD)
        return None if std is None else cls._from_values(config.get(STD_MEAN), std)

    @classmethod
    def _from_values(cls, mean_values: Any, std_values: Any) -> Standardization:
        malformed = ValueError("the instruction's feature standardisation is malformed (mean and std must be "
                               "equally long lists of finite float32 values, std > 0)")
        try:
            with np.errstate(over="ignore"):
                mean = np.asarray(mean_values, dtype=np.float64).astype(np.float32)
                std = np.asarray(std_values, dtype=np.float64).astype(np.float32)
        except (TypeError, ValueError, OverflowError):
            raise malformed from None
        if mean.ndim != 1 or mean.shape != std.shape or not np.isfinite(mean).all() or not (std > 0).all() \
                or not np.isfinite(std).all():
            raise malformed
        return cls(mean, std)

    def to_info(self) -> dict[str, list[float]]:
        """Return the mean and std as a run stores them in ``info[INFO_KEY]``."""
        return {"mean": [float(v) for v in self.mean], "std": [float(v) for v in self.std]}

    @classmethod
    def from_info(cls, info: Any) -> Standardization | None:
        """From a run's stored ``info[INFO_KEY]`` (``None`` when the run had none)."""
        if not isinstance(info, Mapping):
            return None
        return cls._from_values(info.get("mean"), info.get("std"))

    def apply(self, x: np.ndarray) -> np.ndarray:
        """``(x - mean) / std`` per feature, in ``x``'s shape (float32)."""
        rows = x.reshape(x.shape[0], -1)
        if rows.shape[1] != self.mean.size:
            raise ValueError(f"the data have {rows.shape[1]} features; the run's standardisation has "
                             f"{self.mean.size}")
        scaled: np.ndarray = (rows - self.mean) / self.std
        return scaled.astype(np.float32).reshape(x.shape)


def standardized(data: Any, standardization: Standardization | None) -> Any:
    """Return ``data`` (a dataset with ``x``, or a train/test pair of them) with its features standardised."""
    if standardization is None:
        return data
    if hasattr(data, "x"):
        return replace(data, x=standardization.apply(data.x))
    if hasattr(data, "train") and hasattr(data, "test"):
        return replace(data, train=standardized(data.train, standardization),
                       test=standardized(data.test, standardization))
    raise ValueError(f"data.standardize = \"federated\" needs feature arrays; this task's data "
                     f"({type(data).__name__}) has none")


class StandardizeInputs(nn.Module):
    """``(x - mean) / std`` per feature, in front of an exported model: it then takes raw features.

    ``mean`` and ``std`` are buffers, so they travel in the export's weights.
    """

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, features: int, standardization: Standardization | None = None) -> None:
        super().__init__()
        found = standardization or Standardization(np.zeros(features, np.float32), np.ones(features, np.float32))
        self.register_buffer("mean", torch.from_numpy(np.array(found.mean, dtype=np.float32)))
        self.register_buffer("std", torch.from_numpy(np.array(found.std, dtype=np.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` standardised per feature, in its own shape."""
        rows = x.reshape(x.shape[0], -1)
        return ((rows - self.mean) / self.std).reshape(x.shape)
