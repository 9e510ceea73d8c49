"""Secure aggregation: the server learns only the (weighted) sum of client updates.

A protocol of the Bonawitz et al. (CCS 2017) / Bell et al. (SecAgg+, CCS 2020)
family, written on pyca/cryptography: X25519, HKDF-SHA256 bound to the
round's session, AES-GCM shares, AES-CTR masks, Shamir over GF(2^521 - 1),
stochastic fixed-point quantisation, and dropout recovery at every stage.

Layers, from safe to sharp:

- :func:`secure_sum` runs a whole round in-process;
- :func:`~privacy.secagg.flower_mod.secagg_mod` and
  :func:`~privacy.secagg.flower_workflow.run_secagg` run it over Flower;
- :mod:`privacy.secagg.client` / :mod:`privacy.secagg.server` are the state
  machines, and the modules below them the primitives.
"""

from privacy.secagg.api import secure_sum
from privacy.secagg.config import SecAggConfig
from privacy.secagg.errors import (
    InsufficientSharesError,
    SecAggAborted,
    SecAggConfigError,
    SecAggCryptoError,
    SecAggError,
    SecAggProtocolError,
)
from privacy.secagg.identity import ClientPolicy, IdentityDirectory, enrol
from privacy.secagg.prg import mask_with_seed
from privacy.secagg.result import SecureSumResult, StageStats
from privacy.secagg.server import ServerRound
from privacy.secagg.stage import Stage

__all__ = [
    "ClientPolicy",
    "IdentityDirectory",
    "InsufficientSharesError",
    "SecAggAborted",
    "SecAggConfig",
    "SecAggConfigError",
    "SecAggCryptoError",
    "SecAggError",
    "SecAggProtocolError",
    "SecureSumResult",
    "ServerRound",
    "Stage",
    "StageStats",
    "enrol",
    "mask_with_seed",
    "secure_sum",
]
