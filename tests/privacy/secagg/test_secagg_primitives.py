"""Masks, key derivation, encryption, quantisation, graphs and configuration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from privacy.secagg import SecAggConfig, SecAggConfigError, SecAggCryptoError, mask_with_seed
from privacy.secagg.aead import open_share, seal_share, share_aad
from privacy.secagg.graph import build_graph, harary_graph, neighbours
from privacy.secagg.keys import PublicKeys, pair_mask_key, session_digest
from privacy.secagg.prg import MaskExpander
from privacy.secagg.quantize import Quantizer


# -- masks ----------------------------------------------------------------------
def test_mask_known_answer_aes128_zero_key():
    # AES-128(key=0) of counter block 0^96 || 2 = 0388dace 60b6a392 f328c2b9
    # 71b2fe78: the ciphertext of the GCM specification's test case 2
    # (McGrew & Viega), read as little-endian uint32.
    mask = mask_with_seed(bytes(16), 4)

    assert mask.tolist() == [0xCEDA8803, 0x92A3B660, 0xB9C228F3, 0x78FEB271]


@pytest.mark.parametrize("length", [1, 4, 65_537, 200_003])
def test_mask_is_the_aes_ctr_keystream_from_counter_two(length):
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = bytes(range(16))
    counter = Cipher(algorithms.AES(key), modes.CTR(bytes(15) + b"\x02")).encryptor()

    assert mask_with_seed(key, length).tobytes() == counter.update(bytes(4 * length))


def test_mask_is_deterministic_per_seed_and_differs_between_seeds():
    a1 = mask_with_seed(b"k" * 16, 1000)
    a2 = mask_with_seed(b"k" * 16, 1000)
    b = mask_with_seed(b"j" * 16, 1000)

    assert np.array_equal(a1, a2)
    assert np.mean(a1 == b) < 0.01


def test_mask_64_bit_is_the_same_keystream_read_wider():
    narrow = mask_with_seed(b"k" * 16, 4, 32)
    wide = mask_with_seed(b"k" * 16, 2, 64)

    assert wide.tobytes() == narrow.tobytes()
    assert wide.dtype == np.dtype("<u8")


def test_expander_adds_and_subtracts_modulo_ring():
    acc = np.full(5, 2**32 - 1, dtype="<u4")
    expander = MaskExpander(5, 32)

    expander.add_all(acc, [b"a" * 16], [])
    expander.add_all(acc, [], [b"a" * 16])

    assert acc.tolist() == [2**32 - 1] * 5


def _session(round_id: int) -> bytes:
    directory = [PublicKeys(1, b"\x01" * 32, b"\x02" * 32), PublicKeys(2, b"\x03" * 32, b"\x04" * 32)]
    return session_digest(round_id, b"setup", directory)


def test_pair_mask_keys_are_symmetric_and_differ_per_round():
    shared = b"s" * 32

    k12 = pair_mask_key(shared, _session(1), 1, 2, 100, 32)
    k21 = pair_mask_key(shared, _session(1), 2, 1, 100, 32)
    k12_round2 = pair_mask_key(shared, _session(2), 1, 2, 100, 32)

    assert k12 == k21
    assert k12 != k12_round2
    assert not np.array_equal(mask_with_seed(k12, 100), mask_with_seed(k12_round2, 100))


# -- share encryption -------------------------------------------------------------
def test_sealed_share_rejects_tampering_and_rebinding():
    key, session = b"k" * 16, _session(1)
    sealed = seal_share(key, share_aad(session, 1, 2), b"shares")
    flipped = bytes([sealed[0] ^ 1]) + sealed[1:]

    assert open_share(key, share_aad(session, 1, 2), sealed) == b"shares"
    with pytest.raises(SecAggCryptoError):
        open_share(key, share_aad(session, 1, 2), flipped)
    with pytest.raises(SecAggCryptoError):
        open_share(key, share_aad(session, 1, 3), sealed)  # re-addressed
    with pytest.raises(SecAggCryptoError):
        open_share(key, share_aad(_session(2), 1, 2), sealed)  # replayed next round
    with pytest.raises(SecAggCryptoError, match="^secure aggregation: cryptographic verification failed$"):
        open_share(b"x" * 16, share_aad(session, 1, 2), sealed)


# -- quantisation -----------------------------------------------------------------
def test_quantizer_bound_by_hand():
    # 10 clients, 32 bits: B = (2^31 - 1) // 10 - 1 = 214748363; c = 2 -> scale B / 2.
    q = Quantizer(32, 2.0, 10)

    assert q.bound == 214_748_363
    assert q.scale == 214_748_363 / 2
    assert q.error_bound(10) == pytest.approx(10 * 2 / 214_748_363)


@pytest.mark.parametrize("bits", [16, 32, 64])
def test_quantizer_round_trip_within_bound(bits):
    rng = np.random.default_rng(1)
    q = Quantizer(bits, 1.0, 8)
    xs = [rng.uniform(-1.5, 1.5, 300) for _ in range(8)]
    total = np.zeros(301, dtype={16: np.uint16, 32: np.uint32, 64: np.uint64}[bits])

    for x in xs:
        total += q.encode(x, 0.5, rng)
    values, weight = q.decode(total)

    expected = sum(0.5 * np.clip(x, -1, 1) for x in xs)
    assert np.abs(values - expected).max() <= q.error_bound(8)
    assert weight == pytest.approx(4.0, abs=q.weight_error_bound(8))


def test_a_16_bit_ring_has_2_to_the_15_steps_over_the_clients_and_refuses_too_many():
    # (2^15 - 1) // 8 - 1 = 4094 steps per client over [-clip, clip]
    assert Quantizer(16, 1.0, 8).bound == 4094
    with pytest.raises(ValueError, match="16-bit ring cannot sum 40000"):
        _ = Quantizer(16, 1.0, 40_000).bound


def test_stochastic_rounding_is_unbiased():
    # A value a third of the way between two steps rounds up a third of the time.
    rng = np.random.default_rng(2)
    q = Quantizer(32, 1.0, 2)
    x = np.full(60_000, (1000 + 1 / 3) / q.scale)

    codes = q.encode(x, 1.0, rng)[:-1].view(np.int32)

    assert set(np.unique(codes)) == {1000, 1001}
    assert np.mean(codes) - 1000 == pytest.approx(1 / 3, abs=0.01)


def test_quantizer_rejects_nan_and_bad_weights():
    q = Quantizer(32, 1.0, 2)
    rng = np.random.default_rng(0)

    with pytest.raises(ValueError, match="finite"):
        q.encode(np.array([0.0, np.nan]), 1.0, rng)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        q.encode(np.zeros(3), 1.5, rng)


# -- graphs -------------------------------------------------------------------------
@pytest.mark.parametrize(("n", "k"), [(10, 4), (10, 3), (11, 6), (100, 20), (7, 6)])
def test_harary_graph_is_symmetric_and_k_regular(n, k):
    ids = list(range(100, 100 + n))

    graph = build_graph("kregular", ids, k, b"s" * 32)

    assert all(len(graph[u]) == k and u not in graph[u] for u in ids)
    assert all(u in graph[v] for u in ids for v in graph[u])


def test_one_clients_neighbours_match_the_whole_graph():
    ids = list(range(40))

    for kind, k in (("kregular", 7), ("kregular", 39), ("complete", 39)):
        graph = build_graph(kind, ids, k, b"z" * 32)
        assert all(neighbours(kind, ids, k, b"z" * 32, u) == graph[u] for u in ids)


def test_harary_graph_depends_on_the_seed_only():
    ids = list(range(50))

    assert harary_graph(ids, 6, b"a" * 32) == harary_graph(ids, 6, b"a" * 32)
    assert harary_graph(ids, 6, b"a" * 32) != harary_graph(ids, 6, b"b" * 32)


# -- configuration --------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("threshold", 1), ("threshold", 1.5), ("threshold", True), ("graph", "ring"),
    ("degree", 1), ("clip_range", 0.0), ("clip_range", math.inf), ("bits", 24),
    ("max_weight", -1.0), ("stage_timeout_s", 0),
])
def test_config_errors_name_field_and_value(field, value):
    with pytest.raises(SecAggConfigError, match=rf"SecAggConfig\.{field}={value!r}") as info:
        SecAggConfig(**{field: value})
    assert info.value.field == field


def test_config_resolution_by_hand():
    complete = SecAggConfig()
    sparse = SecAggConfig(graph="kregular")

    assert (complete.degree_for(100), complete.threshold_for(100)) == (99, 51)
    assert (sparse.degree_for(100), sparse.threshold_for(100)) == (20, 11)  # ceil(3 log2 100) = 20
    assert sparse.degree_for(9) == 8  # ceil(3 log2 9) = 10 > n - 1
    assert SecAggConfig(graph="kregular", degree=5).degree_for(11) == 6  # 5 * 11 odd
    assert SecAggConfig(threshold=0.3, threat_model="semi-honest").threshold_for(10) == 3
    assert SecAggConfig(threshold=0.51).threshold_for(10) == 6


def test_config_threshold_above_neighbourhood_is_rejected():
    with pytest.raises(SecAggConfigError, match=r"threshold=12: t=12 exceeds the neighbourhood size 10"):
        SecAggConfig(threshold=12).threshold_for(10)
