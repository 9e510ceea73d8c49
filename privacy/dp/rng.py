"""The one source of randomness for DP noise: a cryptographically seeded generator.

Every function in ``privacy.dp`` that draws noise takes an
``np.random.Generator`` argument; production callers pass :func:`secure_rng`,
tests pass a seeded generator. Nothing here touches numpy's global state.
"""

from __future__ import annotations

import secrets

import numpy as np

__all__ = ["secure_rng"]


def secure_rng() -> np.random.Generator:
    """Return a fresh PCG64DXSM generator seeded with 256 bits from the OS CSPRNG.

    The seed comes from :func:`secrets.token_bytes` and is never stored, so
    neither the aggregator's operator nor anyone holding the scenario file can
    regenerate the noise and subtract it. PCG64DXSM is numpy's recommended
    bit generator for new code (O'Neill, "PCG: A Family of Simple Fast
    Space-Efficient Statistically Good Algorithms for Random Number
    Generation", 2014; the DXSM output function, numpy 1.21+).

    Returns
    -------
    np.random.Generator
        A generator private to the caller.
    """
    seed = int.from_bytes(secrets.token_bytes(32), "little")
    return np.random.Generator(np.random.PCG64DXSM(seed))
