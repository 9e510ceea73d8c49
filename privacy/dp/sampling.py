"""Client sampling that matches what the accountant assumes.

Amplification by sampling (the ``q`` in the accountant) holds only if (a)
clients are sampled exactly as the accountant models it and (b) the sample
stays secret from whoever the guarantee is stated against. A sample drawn
from the scenario's seed is reproducible by anyone holding the scenario file,
so DP rounds sample with a generator from :func:`privacy.dp.secure_rng`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from privacy.dp.accountant import Sampling
from privacy.dp.errors import DPConfigError

__all__ = ["sample_clients"]


def sample_clients(
    node_ids: Sequence[int], expected: int, population: int, sampling: Sampling, rng: np.random.Generator
) -> list[int]:
    """Choose the clients of one DP round.

    Parameters
    ----------
    node_ids : sequence of int
        Clients reachable now, at most ``population`` of them.
    expected : int
        ``m``: clients per round (expected for Poisson, exact for fixed).
    population : int
        ``N`` as given to the accountant.
    sampling : {"poisson", "fixed"}
        ``poisson``: each reachable client joins with probability ``m / N``
        independently (unreachable ones count as sampled-and-dropped, which
        only helps privacy). ``fixed``: exactly ``m`` of the ``N`` clients,
        without replacement; all ``N`` must be reachable, else each client's
        chance would exceed ``m / N``.
    rng : np.random.Generator
        :func:`privacy.dp.secure_rng` outside tests.

    Returns
    -------
    list of int
        The sampled node ids, sorted (may be empty under Poisson sampling).

    References
    ----------
    McMahan et al., ICLR 2018, Algorithm 1 (each user selected independently
    with probability q).
    """
    ordered = sorted(node_ids)
    if len(ordered) > population:
        raise DPConfigError("population", population, f"is smaller than the {len(ordered)} clients reachable")
    if sampling == "poisson":
        chosen = np.flatnonzero(rng.random(len(ordered)) < expected / population)
    elif sampling == "fixed":
        if len(ordered) != population:
            raise DPConfigError("sampling", sampling, f"fixed-size sampling needs all {population} clients "
                                f"reachable, {len(ordered)} are; use 'poisson'")
        chosen = rng.choice(len(ordered), size=expected, replace=False)
    else:
        raise DPConfigError("sampling", sampling, "must be 'poisson' or 'fixed'")
    return sorted(ordered[int(i)] for i in chosen)
