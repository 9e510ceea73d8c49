"""A secure sum across the edges (``[hierarchy] secure_across_edges``): the aggregator learns only the global sum.

The edges are the parties of one secure-aggregation round (Bonawitz et al.,
CCS 2017, the protocol of :mod:`privacy.secagg`), with the aggregator as its
server: each edge masks its mean update, weighted by its weight, and the
aggregator unmasks only their sum. In simulation the round runs in this
process through :func:`privacy.secagg.api.secure_sum` (every party's steps and
the server's, with no transport); the aggregator's part sees only masked
vectors. The ``[secagg]`` settings (ring bits, clip range, threshold, threat
model) are the ones each edge's own cohort runs with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from core.aggregate import MeanState
from privacy.secagg.api import secure_sum
from privacy.secagg.result import SecureSumResult
from privacy.secagg.train import config_from_spec
from scenarios.threats import SecAggSpec

__all__ = ["secure_edge_sum"]


def secure_edge_sum(secrets: Sequence[MeanState], spec: SecAggSpec, *, seed: int,
                    server_round: int) -> SecureSumResult:
    """Securely sum the edges' ``secrets`` (each edge's running sum): ``sum_e w_e x_e`` and ``sum_e w_e``.

    Each edge enters its mean ``x_e = total_e / w_e`` with weight ``w_e`` (the
    protocol quantises ``w_e / max_e w_e`` with it), so the result's total and
    weight are the edges' sums summed, up to the ring's rounding
    (``error_bound``).

    Raises
    ------
    privacy.secagg.errors.SecAggAborted
        Too few edges survived a stage.
    privacy.secagg.errors.SecAggConfigError
        Too few edges answered to run the protocol at all.
    """
    weights = [float(s.weight) for s in secrets]
    config = replace(config_from_spec(spec), max_weight=max(weights))
    means = [np.asarray(s.total, dtype=np.float64) / s.weight for s in secrets]
    rng = np.random.default_rng([seed, server_round, 0xED6E])  # stochastic rounding only, never key material
    return secure_sum(means, weights, config, rng=rng, server_round=server_round)
