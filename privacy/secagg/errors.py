"""Every exception raised by :mod:`privacy.secagg`, in one flat module.

A client that drops out is data (it simply is not among the survivors), never
an exception. Exceptions are for misconfiguration, for a round that can no
longer finish (:class:`SecAggAborted`), for a peer that breaks the protocol
(:class:`SecAggProtocolError`) and for anything a cryptographic check rejects
(:class:`SecAggCryptoError`, deliberately opaque, as in pyca/cryptography's
``InvalidTag``: it never says which check failed).
"""

from __future__ import annotations

from core.errors import QuorumError
from privacy.secagg.stage import Stage

__all__ = [
    "InsufficientSharesError",
    "SecAggAborted",
    "SecAggConfigError",
    "SecAggCryptoError",
    "SecAggError",
    "SecAggProtocolError",
]


class SecAggError(QuorumError):
    """Base class of every secure-aggregation error."""


class SecAggConfigError(SecAggError, ValueError):
    """A configuration value is invalid; the message names the field and value.

    Parameters
    ----------
    field : str
        The name of the offending field.
    value : object
        The offending value.
    reason : str
        What the value must be instead.
    """

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        super().__init__(f"SecAggConfig.{field}={value!r}: {reason}")


class SecAggCryptoError(SecAggError):
    """A cryptographic check failed (bad tag, bad key, inconsistent shares)."""

    def __init__(self) -> None:
        super().__init__("secure aggregation: cryptographic verification failed")


class SecAggProtocolError(SecAggError):
    """A peer (client or server) deviated from the protocol; the client refuses."""


class InsufficientSharesError(SecAggError, ValueError):
    """Shamir reconstruction was asked for with fewer shares than the threshold.

    Parameters
    ----------
    have : int
        The number of distinct shares supplied.
    threshold : int
        The number required.
    """

    def __init__(self, have: int, threshold: int) -> None:
        self.have = have
        self.threshold = threshold
        super().__init__(
            f"Shamir reconstruction needs {threshold} shares, got {have}"
        )


class SecAggAborted(SecAggError):
    """The round cannot finish: too few clients survived a stage.

    Parameters
    ----------
    stage : Stage
        The stage after which the survivors fell below the threshold.
    survivors : int
        How many clients (or, for a sparse graph, how many members of the
        thinnest neighbourhood) were still alive after that stage.
    threshold : int
        The Shamir threshold ``t`` that was needed.
    sampled : int | None
        How many clients the round started with, when known.
    detail : str
        Extra context, e.g. which neighbourhood ran dry.
    """

    def __init__(self, stage: Stage, survivors: int, threshold: int, *,
                 sampled: int | None = None, detail: str = "") -> None:
        self.stage = stage
        self.survivors = survivors
        self.threshold = threshold
        self.sampled = sampled
        of = f" of {sampled} sampled" if sampled is not None else ""
        tail = f" ({detail})" if detail else ""
        super().__init__(
            f"secure aggregation aborted at stage '{stage.value}': {survivors}{of} "
            f"clients survived, threshold is {threshold}{tail}"
        )
