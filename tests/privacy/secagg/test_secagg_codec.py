"""Wire format: every message round-trips; truncated or foreign bytes are refused."""

from __future__ import annotations

import numpy as np
import pytest

from privacy.secagg import SecAggProtocolError
from privacy.secagg.codec import decode, encode, wire_size
from privacy.secagg.keys import PublicKeys
from privacy.secagg.messages import (
    EncryptedShare,
    KeyAdvertisement,
    KeyDirectory,
    MaskedInput,
    MaskedInputRequest,
    RevealedShare,
    RoundSetup,
    ShareKeysReply,
    UnmaskReply,
    UnmaskRequest,
)
from privacy.secagg.shamir import PRIME

SHARES = (EncryptedShare(1, 2, b"c" * 148), EncryptedShare(1, 3, b"d" * 148))
MESSAGES = [
    RoundSetup(7, (1, 2, 3), 2, "kregular", 2, b"s" * 32, 1.5, 32, 100.0),
    KeyAdvertisement(b"a" * 32, b"b" * 32),
    KeyDirectory((PublicKeys(1, b"a" * 32, b"b" * 32), PublicKeys(2**64 - 1, b"c" * 32, b"d" * 32))),
    ShareKeysReply(b"h" * 32, SHARES),
    MaskedInputRequest(SHARES),
    MaskedInputRequest(()),
    UnmaskRequest((1, 2), (3,)),
    UnmaskReply((RevealedShare(1, PRIME - 1),), (RevealedShare(3, 0), RevealedShare(4, 12345))),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    data = encode(message)

    assert decode(data, type(message)) == message
    assert wire_size(message) == len(data)


@pytest.mark.parametrize("bits", [16, 32, 64])
def test_masked_input_round_trips(bits):
    vector = np.arange(5, dtype=f"<u{bits // 8}")

    data = encode(MaskedInput(vector))

    assert np.array_equal(decode(data, MaskedInput).vector, vector)
    assert wire_size(MaskedInput(vector)) == len(data) == 2 + 9 + vector.nbytes


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_truncated_or_padded_bytes_are_refused(message):
    data = encode(message)

    with pytest.raises(SecAggProtocolError):
        decode(data[:-1], type(message))
    with pytest.raises(SecAggProtocolError, match="trailing"):
        decode(data + b"\0", type(message))


def test_a_message_of_another_type_is_refused():
    with pytest.raises(SecAggProtocolError, match="expected a KeyDirectory"):
        decode(encode(KeyAdvertisement(b"a" * 32, b"b" * 32)), KeyDirectory)


def test_a_huge_length_prefix_does_not_allocate():
    data = bytes([1, 3]) + (2**32 - 1).to_bytes(4, "big")

    with pytest.raises(SecAggProtocolError, match="truncated"):
        decode(data, KeyDirectory)
