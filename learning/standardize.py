"""Federated feature standardisation: every feature scaled to zero mean and unit variance, from sums alone.

``[data] standardize = "federated"`` runs a statistics pass before round 1.
Each client answers a train instruction marked :data:`PASS_KEY` not with a
model update but with the vector ``[mean / S, mean_of_squares / S^2, over]``
of its training rows, weighted by its row count. The round's fit workflow
folds these like updates, so under ``[secagg]`` the server learns only the
weighted sum (no device reveals its own statistics), and without it the
same checks as for an update apply. ``S`` is a public scale: a client whose
values do not fit the protocol's clip range (``limit``) sets ``over``, the
server sees only that some client did, and asks again with ``S`` 256 times
larger (:data:`SCALES`). From the global mean and mean of squares,
``std = sqrt(E[x^2] - E[x]^2)``, floored at :data:`STD_FLOOR` x ``S`` so that
a constant column (a border pixel) is not blown up by rounding noise.

Every later train and evaluate instruction carries the mean and std
(:meth:`Standardization.to_extra`); clients standardise their rows with them
before the task sees the data, and the aggregator its own held-out set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["PASS_KEY", "LIMIT_KEY", "MEAN_KEY", "STD_KEY", "SCALES", "STD_FLOOR", "moments_vector",
           "Standardization", "standardized", "feature_rows", "asks_for_statistics", "StandardizeInputs", "INFO_KEY"]

#: The run's ``info`` key holding its standardisation (``quorum export`` puts it in front of the model).
INFO_KEY = "standardization"

#: ``TrainConfig.extra``: this instruction asks for statistics at this scale, not for training.
PASS_KEY = "std-pass"
#: ``TrainConfig.extra``: the largest value a statistic may take (the secure-aggregation clip range).
LIMIT_KEY = "std-limit"
#: ``TrainConfig.extra``: the features' mean and std every later instruction carries.
MEAN_KEY, STD_KEY = "std-mean", "std-std"
#: The scales the server tries in turn: features up to about 1, 256, 65,536 and 1.7e7.
SCALES = (1.0, 2.0**8, 2.0**16, 2.0**24)
#: A feature whose std is below this x the scale counts as constant: it is centred but not rescaled.
STD_FLOOR = 1e-3


def asks_for_statistics(content: Any) -> bool:
    """Whether a train instruction's records (a Flower ``RecordDict``) ask for the pass, not training."""
    settings = content.config_records.get("config")
    return settings is not None and f"x.{PASS_KEY}" in settings


def feature_rows(x: np.ndarray) -> np.ndarray:
    """The examples as rows of features (an image's pixels are its features), in float64."""
    return np.asarray(x, dtype=np.float64).reshape(x.shape[0], -1)


def moments_vector(x: np.ndarray, scale: float, limit: float) -> np.ndarray:
    """``[mean / S, mean of squares / S^2, over]`` of one client's rows: what it sends in the pass.

    ``over`` is 1 when a value exceeds ``limit`` (the server then asks at a
    larger scale); the values are clipped to ``[-limit, limit]`` either way.
    An empty or non-finite set of rows is an error, never a vector.
    """
    if x.shape[0] == 0:
        raise ValueError("no training rows to take statistics of")
    rows = feature_rows(x)
    if not np.isfinite(rows).all():
        raise ValueError("the training rows hold NaN or Inf values")
    stats = np.concatenate([rows.mean(axis=0) / scale, (rows**2).mean(axis=0) / scale**2])
    over = float(np.abs(stats).max(initial=0.0) > limit)
    return np.append(np.clip(stats, -limit, limit), over).astype(np.float32)


@dataclass(frozen=True)
class Standardization:
    """Per-feature mean and std (float32, one value per feature)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def from_vector(cls, mean_vector: np.ndarray, features: int, scale: float) -> Standardization:
        """From the pass's weighted mean ``[E[x] / S, E[x^2] / S^2, over]`` at scale ``S``."""
        v = np.asarray(mean_vector, dtype=np.float64)
        if v.shape != (2 * features + 1,) or not np.isfinite(v).all():
            raise ValueError(f"statistics vector of shape {v.shape}, expected ({2 * features + 1},) finite values")
        mean, meansq = v[:features] * scale, v[features:2 * features] * scale**2
        std = np.sqrt(np.maximum(meansq - mean**2, 0.0))
        std = np.where(std < STD_FLOOR * scale, 1.0, std)  # constant (up to rounding): leave its scale alone
        return cls(mean.astype(np.float32), std.astype(np.float32))

    def to_extra(self) -> dict[str, list[float]]:
        return {MEAN_KEY: [float(v) for v in self.mean], STD_KEY: [float(v) for v in self.std]}

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> Standardization | None:
        """The standardisation an instruction carries, or ``None``; a malformed one is a ``ValueError``."""
        if MEAN_KEY not in extra and STD_KEY not in extra:
            return None
        malformed = ValueError("the instruction's feature standardisation is malformed (mean and std must be "
                               "equally long lists of finite float32 values, std > 0)")
        try:
            with np.errstate(over="ignore"):
                mean = np.asarray(extra.get(MEAN_KEY), dtype=np.float64).astype(np.float32)
                std = np.asarray(extra.get(STD_KEY), dtype=np.float64).astype(np.float32)
        except (TypeError, ValueError, OverflowError):
            raise malformed from None
        if mean.ndim != 1 or mean.shape != std.shape or not np.isfinite(mean).all() or not (std > 0).all() \
                or not np.isfinite(std).all():
            raise malformed
        return cls(mean, std)

    def to_info(self) -> dict[str, list[float]]:
        return {"mean": [float(v) for v in self.mean], "std": [float(v) for v in self.std]}

    @classmethod
    def from_info(cls, info: Any) -> Standardization | None:
        """From a run's stored ``info[INFO_KEY]`` (``None`` when the run had none)."""
        if not isinstance(info, Mapping):
            return None
        return cls.from_extra({MEAN_KEY: info.get("mean"), STD_KEY: info.get("std")})

    def apply(self, x: np.ndarray) -> np.ndarray:
        """``(x - mean) / std`` per feature, in ``x``'s shape (float32)."""
        rows = x.reshape(x.shape[0], -1)
        if rows.shape[1] != self.mean.size:
            raise ValueError(f"the data have {rows.shape[1]} features; the run's standardisation has "
                             f"{self.mean.size}")
        return ((rows - self.mean) / self.std).astype(np.float32).reshape(x.shape)


def standardized(data: Any, standardization: Standardization | None) -> Any:
    """``data`` (a dataset with ``x``, or a train/test pair of them) with its features standardised."""
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
        rows = x.reshape(x.shape[0], -1)
        return ((rows - self.mean) / self.std).reshape(x.shape)
