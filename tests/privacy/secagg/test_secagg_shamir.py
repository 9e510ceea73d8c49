"""Shamir sharing over GF(2^521 - 1): every t-subset rebuilds, fewer fail loudly."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from privacy.secagg.errors import InsufficientSharesError, SecAggCryptoError
from privacy.secagg.shamir import PRIME, combine, lagrange_at_zero, random_element, split
from privacy.secagg.unmask import rebuild_verified


def counter_entropy(label: bytes):
    """Deterministic entropy: SHAKE-256 over a counter (known-answer tests only)."""
    state = {"i": 0}

    def draw(n: int) -> bytes:
        state["i"] += 1
        return hashlib.shake_256(label + state["i"].to_bytes(8, "big")).digest(n)

    return draw


SECRET = bytes(range(32))


def test_polynomial_worked_by_hand():
    # Prepare: f(x) = s + 5x with s = 7 (coefficient drawn as 5), t = 2.
    def entropy(n: int) -> bytes:
        return (5).to_bytes(n, "big")

    # Execute
    shares = split((7).to_bytes(32, "big"), 2, [1, 2, 3], entropy)

    # Assert: f(1) = 12, f(2) = 17, f(3) = 22; any two rebuild 7.
    assert shares == [12, 17, 22]
    assert combine({2: 17, 3: 22}, 2) == (7).to_bytes(32, "big")


def test_lagrange_coefficients_by_hand():
    # For xs = (1, 2): l_1 = 2 / (2 - 1) = 2, l_2 = 1 / (1 - 2) = -1.
    assert lagrange_at_zero((1, 2)) == (2, PRIME - 1)


@pytest.mark.parametrize(("n", "t"), [(5, 3), (6, 2), (6, 6), (7, 4)])
def test_every_threshold_subset_rebuilds(n, t):
    xs = list(range(1, n + 1))
    shares = dict(zip(xs, split(SECRET, t, xs, counter_entropy(b"s")), strict=True))

    for size in range(t, n + 1):
        for subset in itertools.combinations(xs, size):
            assert combine({x: shares[x] for x in subset}, t) == SECRET


@pytest.mark.parametrize(("n", "t"), [(5, 3), (7, 4)])
def test_every_subset_below_threshold_fails_clearly(n, t):
    xs = list(range(1, n + 1))
    shares = dict(zip(xs, split(SECRET, t, xs, counter_entropy(b"s")), strict=True))

    for subset in itertools.combinations(xs, t - 1):
        with pytest.raises(InsufficientSharesError, match=f"needs {t} shares, got {t - 1}"):
            combine({x: shares[x] for x in subset}, t)


def test_fewer_than_threshold_shares_reveal_nothing_checkable():
    # With t - 1 shares every secret is consistent: the share vector for
    # SECRET and for another secret can coincide on t - 1 points.
    xs = [1, 2, 3]
    a = split(SECRET, 3, xs, counter_entropy(b"a"))
    b = split(bytes(32), 3, xs, counter_entropy(b"b"))
    assert a != b  # and nothing below relies on them being related


def test_a_garbled_share_is_detected():
    # A garbled share turns f(0) into a random field element, above 2^256
    # but with probability 2^-265. (A crafted small offset is caught later, by
    # the server's commitment / public-key check: see rebuild_verified.)
    xs = [1, 2, 3, 4]
    shares = dict(zip(xs, split(SECRET, 3, xs, counter_entropy(b"c")), strict=True))
    shares[2] = random_element(counter_entropy(b"garble"))

    with pytest.raises(SecAggCryptoError):
        combine(shares, 3)


def test_rebuild_verified_skips_a_crafted_bad_share():
    xs = [1, 2, 3, 4]
    shares = dict(zip(xs, split(SECRET, 3, xs, counter_entropy(b"c")), strict=True))
    shares[2] = (shares[2] + 1) % PRIME  # f(0) shifts by l_2 = -3: still 32 bytes

    assert rebuild_verified(shares, 3, lambda s: s == SECRET) == SECRET
    with pytest.raises(SecAggCryptoError):
        rebuild_verified({x: shares[x] for x in (1, 2, 3)}, 3, lambda s: s == SECRET)


def test_split_rejects_bad_inputs():
    with pytest.raises(ValueError, match="32 bytes"):
        split(b"short", 2, [1, 2], counter_entropy(b"x"))
    with pytest.raises(ValueError, match="distinct"):
        split(SECRET, 2, [1, 1], counter_entropy(b"x"))
    with pytest.raises(ValueError, match="threshold 3"):
        split(SECRET, 3, [1, 2], counter_entropy(b"x"))


def test_random_element_is_below_the_prime():
    draw = counter_entropy(b"r")
    assert all(0 <= random_element(draw) < PRIME for _ in range(200))
