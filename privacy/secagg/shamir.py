"""Shamir secret sharing over the Mersenne prime field GF(2^521 - 1).

Shamir, "How to Share a Secret", CACM 1979. Secrets are 32-byte strings (an
X25519 private key or a self-mask seed), read as integers below 2^256, so one
field element holds one secret with no chunking (Flower shares a 306-byte PEM
key in 16-byte GF(2^128) chunks, which is where its 2-3 s per key go).
Lagrange coefficients at zero depend only on the x-coordinates, so they are
cached: the server rebuilds many secrets from the same survivor set, as in
Google's production SecAgg (fcp/secagg).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache

from privacy.secagg.errors import InsufficientSharesError, SecAggCryptoError

__all__ = [
    "PRIME",
    "SECRET_BYTES",
    "SHARE_BYTES",
    "combine",
    "lagrange_at_zero",
    "random_element",
    "split",
]

PRIME = (1 << 521) - 1
SECRET_BYTES = 32
SHARE_BYTES = 66  # ceil(521 / 8)

Entropy = Callable[[int], bytes]


def random_element(entropy: Entropy) -> int:
    """Draw a uniform element of GF(PRIME), by rejection sampling 521-bit strings."""
    while True:
        value = int.from_bytes(entropy(SHARE_BYTES), "big") & PRIME
        if value < PRIME:
            return value


def _check_points(xs: Sequence[int], threshold: int) -> None:
    if threshold < 1:
        raise ValueError(f"threshold must be >= 1, got {threshold}")
    if len(xs) < threshold:
        raise ValueError(f"cannot split into {len(xs)} shares with threshold {threshold}")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("share x-coordinates must be distinct and in [1, PRIME)")


def split(secret: bytes, threshold: int, xs: Sequence[int], entropy: Entropy) -> list[int]:
    """Share ``secret`` so that any ``threshold`` of the points rebuild it.

    Parameters
    ----------
    secret : bytes
        Exactly :data:`SECRET_BYTES` bytes.
    threshold : int
        Degree of the polynomial plus one.
    xs : Sequence[int]
        Distinct non-zero x-coordinates, one per share holder.
    entropy : Callable[[int], bytes]
        Source of the random coefficients (``os.urandom`` in production).

    Returns
    -------
    list[int]
        The y-values ``f(x)`` in the order of ``xs``.
    """
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"secret must be {SECRET_BYTES} bytes, got {len(secret)}")
    _check_points(xs, threshold)
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [random_element(entropy) for _ in range(threshold - 1)]
    coefficients.reverse()
    return [_horner(coefficients, x) for x in xs]


def _horner(coefficients: Sequence[int], x: int) -> int:
    acc = 0
    for c in coefficients:
        acc = (acc * x + c) % PRIME
    return acc


@lru_cache(maxsize=4096)
def lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Coefficients ``l_j`` with ``f(0) = sum_j l_j f(x_j)`` (cached per ``xs``)."""
    numerator = 1
    for x in xs:
        numerator = numerator * x % PRIME
    out = []
    for j, xj in enumerate(xs):
        denominator = xj
        for m, xm in enumerate(xs):
            if m != j:
                denominator = denominator * (xm - xj) % PRIME
        out.append(numerator * pow(denominator, -1, PRIME) % PRIME)
    return tuple(out)


def combine(points: Mapping[int, int], threshold: int) -> bytes:
    """Rebuild a secret from ``{x: y}`` shares.

    Uses the ``threshold`` smallest x-coordinates, so that one survivor set
    always hits the same cached Lagrange coefficients.

    Raises
    ------
    InsufficientSharesError
        Fewer than ``threshold`` shares were given.
    SecAggCryptoError
        The shares are inconsistent (the result is not a 32-byte secret).
    """
    if len(points) < threshold:
        raise InsufficientSharesError(len(points), threshold)
    xs = tuple(sorted(points)[:threshold])
    coefficients = lagrange_at_zero(xs)
    value = sum(c * points[x] for c, x in zip(coefficients, xs, strict=True)) % PRIME
    if value >> (8 * SECRET_BYTES):
        # A wrong share turns f(0) into a uniform field element; one below
        # 2^256 happens with probability 2^-265.
        raise SecAggCryptoError()
    return value.to_bytes(SECRET_BYTES, "big")
