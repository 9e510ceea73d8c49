"""Uplink encoders and the downlink broadcast (core.compress): bounds, unbiasedness, exact decoders, hostile input."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array
from hypothesis import given, settings
from hypothesis import strategies as st

from core.broadcast import Broadcast
from core.compress import (
    Codec,
    decode_gaps,
    dequantize,
    encode_gaps,
    pack_bits,
    quantize,
    shared_index,
    top_k_index,
    unpack_bits,
    with_feedback,
)
from core.errors import UpdateRejected
from core.layouts import ParamLayout, npy_bytes
from privacy.secagg import SecAggConfig, secure_sum


@given(bits=st.integers(1, 16), data=st.data())
@settings(max_examples=60, deadline=None)
def test_pack_unpack_roundtrip_every_width(bits, data):
    # Prepare
    codes = np.array(data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=200)), dtype=np.uint16)
    # Execute
    packed = pack_bits(codes, bits)
    # Assert: exactly ceil(n * bits / 8) bytes, and the same codes back
    assert packed.size == (codes.size * bits + 7) // 8
    assert np.array_equal(unpack_bits(packed, bits, codes.size), codes)


@pytest.mark.parametrize("bits", [1, 3, 4, 7, 8, 11, 16])
def test_packing_in_chunks_gives_the_same_bytes(monkeypatch, bits):
    # Prepare: 100 codes in passes of 16 (a multiple of 8: every pass but the last fills whole bytes)
    import core.compress as compress

    codes = np.random.default_rng(bits).integers(0, 1 << bits, 100).astype(np.uint16)
    whole = pack_bits(codes, bits)
    # Execute
    monkeypatch.setattr(compress, "_PACK_CHUNK", 16)
    chunked = pack_bits(codes, bits)
    # Assert
    assert np.array_equal(chunked, whole) and np.array_equal(unpack_bits(chunked, bits, 100), codes)


def test_quantize_two_bits_rounds_up_with_the_right_probability():
    # Prepare: 2 bits on [-1, 1] are the levels -1, -1/3, 1/3, 1; 0.3 lies between -1/3 and 1/3,
    # so it rounds up with probability (0.3 + 1/3) / (2/3) = 0.95 and the mean is 0.3
    x = np.full(40_000, 0.3, dtype=np.float32)
    x[0] = 1.0  # sets m = 1
    # Execute
    codes, m = quantize(x, 2, np.random.default_rng(0))
    out = dequantize(codes, 2, m)
    # Assert
    assert m == 1.0
    up = np.isclose(out[1:], 1 / 3, atol=1e-6)
    assert np.all(up | np.isclose(out[1:], -1 / 3, atol=1e-6))
    assert abs(float(np.mean(up)) - 0.95) < 0.005
    assert abs(float(np.mean(out[1:])) - 0.3) < 0.005
    assert out[0] == 1.0


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_quantize_is_unbiased_and_within_one_step(bits):
    # Prepare
    x = np.random.default_rng(1).normal(size=64).astype(np.float32)
    m = float(np.max(np.abs(x)))
    step = 2 * m / ((1 << bits) - 1)
    rng = np.random.default_rng(2)
    # Execute
    draws = np.stack([_roundtrip(x, bits, rng) for _ in range(4000)])
    # Assert: every draw within one step; the mean within 5 standard errors (std <= step / 2)
    assert np.all(np.abs(draws - x) <= step * (1 + 1e-5))
    assert np.all(np.abs(draws.mean(axis=0) - x) <= 5 * (step / 2) / np.sqrt(4000))


def _roundtrip(x, bits, rng):
    codes, m = quantize(x, bits, rng)
    return dequantize(codes, bits, m)


def test_top_k_index_picks_largest_magnitudes_sorted():
    assert top_k_index(np.array([0.1, -5.0, 3.0, 0.2, -4.0]), 2).tolist() == [1, 4]
    assert top_k_index(np.array([1.0, 2.0]), 5).tolist() == [0, 1]


def test_shared_index_is_the_same_for_one_seed_and_differs_across_seeds():
    a, b, c = shared_index(1000, 100, 7), shared_index(1000, 100, 7), shared_index(1000, 100, 8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.size == 100 and np.all(np.diff(a.astype(np.int64)) > 0) and a[-1] < 1000


@given(index=st.sets(st.integers(0, 100_000), max_size=300))
@settings(max_examples=100, deadline=None)
def test_gap_encoding_roundtrips_any_sorted_coordinates(index):
    # Prepare
    coords = np.array(sorted(index), dtype=np.int64)
    # Execute
    tokens = encode_gaps(coords)
    # Assert: the same coordinates back; one byte per coordinate plus one per 255 of distance
    assert np.array_equal(decode_gaps(tokens, coords.size, 100_001), coords)
    gaps = np.diff(coords, prepend=0)
    assert tokens.size == coords.size + int(np.sum(gaps // 255))


def test_an_index_longer_than_any_valid_one_is_refused_before_it_is_decoded():
    # 3 coordinates below 1,000 need at most 3 + 1000 // 255 + 1 = 7 bytes; 1 MB of escapes is refused unread
    with pytest.raises(UpdateRejected, match="more than 3 coordinates"):
        decode_gaps(np.full(1_000_000, 255, dtype=np.uint8), 3, 1000)


def test_gap_encoding_by_hand():
    # 3, then +255 (one escape, then 0), then +600 (two escapes, then 90)
    assert encode_gaps(np.array([3, 258, 858])).tolist() == [3, 255, 0, 255, 255, 90]


def test_top_k_float_values_decode_exactly():
    # Prepare
    x = np.array([0.1, -5.0, 3.0, 0.2, -4.0, 0.0, 1.0, -0.5, 2.0, 0.3], dtype=np.float32)
    codec = Codec(topk=0.3, error_feedback=False)
    # Execute
    out = codec.decode(codec.encode(x, np.random.default_rng(0)), x.size)
    # Assert: the three largest magnitudes, exactly; zeros elsewhere
    assert out.tolist() == [0, -5.0, 3.0, 0, -4.0, 0, 0, 0, 0, 0]


def test_random_k_without_feedback_is_unbiased_over_seeds():
    # Prepare: k/d = 1/4, rescaled by 4
    x = np.linspace(-1, 1, 40).astype(np.float32)
    # Execute
    mean = np.mean([Codec(randomk=0.25, error_feedback=False, seed=s).decode(
        Codec(randomk=0.25, error_feedback=False, seed=s).encode(x, np.random.default_rng(0)), 40)
        for s in range(4000)], axis=0)
    # Assert: each coordinate kept with probability 1/4 and scaled by 4: E = x (std <= 4|x| sqrt(3/16) / sqrt(n))
    assert np.all(np.abs(mean - x) <= 5 * 4 * np.abs(x) * np.sqrt(3 / 16) / np.sqrt(4000) + 1e-6)


def test_error_feedback_telescopes_what_was_sent_and_what_is_left():
    # Prepare
    rng = np.random.default_rng(3)
    codec = Codec(topk=0.05, bits=4)
    deltas = [rng.normal(size=200).astype(np.float32) for _ in range(6)]
    residual, sent = None, np.zeros(200)
    # Execute
    for delta in deltas:
        arrays, residual = with_feedback(codec, delta, residual, rng)
        sent += codec.decode(arrays, 200)
    # Assert: everything was either sent or is still held
    assert np.allclose(sent + residual, np.sum(deltas, axis=0), atol=1e-4)


def test_random_k_under_secure_aggregation_sums_the_kept_coordinates():
    # Prepare: five clients keep the round's shared 10% of a 300-value update
    rng = np.random.default_rng(4)
    codec = Codec(randomk=0.1, error_feedback=True, seed=11)
    deltas = [rng.uniform(-0.5, 0.5, size=300) for _ in range(5)]
    selected = [codec.select(d, None) for d in deltas]
    config = SecAggConfig(clip_range=1.0, max_weight=1.0, threat_model="semi-honest", threshold=3)
    # Execute: the masked vectors are 30 values (+ the weight), and the sum is scattered back
    result = secure_sum([v for v, _ in selected], [1.0] * 5, config, rng=rng)
    total = codec.scatter(result.total.astype(np.float32), 300)
    # Assert: the protocol summed exactly the kept coordinates (within its quantisation bound);
    # each residual holds exactly what was not sent
    index = shared_index(300, 30, 11)
    expected = np.zeros(300)
    expected[index] = np.sum(deltas, axis=0)[index]
    assert np.all(np.abs(total - expected) <= result.error_bound + 1e-6)
    assert result.total.shape == (30,)
    for delta, (_, left) in zip(deltas, selected, strict=True):
        assert np.allclose(left + codec.scatter(delta[index].astype(np.float32), 300), delta, atol=1e-6)


@pytest.mark.parametrize("bits", [16, 32])
def test_random_k_values_on_the_grid_sum_exactly_under_secure_aggregation(bits):
    # Prepare: values that are whole grid steps (k / scale) survive quantisation untouched
    config = SecAggConfig(clip_range=1.0, max_weight=1.0, threat_model="semi-honest", threshold=3, bits=bits)
    scale = (2 ** (bits - 1) - 1) // 4 - 1  # the quantiser's steps per unit for 4 participants, clip 1
    rng = np.random.default_rng(5)
    codec = Codec(randomk=0.2, seed=3)
    vectors = [rng.integers(-1000, 1000, size=50) / scale for _ in range(4)]
    # Execute
    result = secure_sum([codec.select(v, None)[0].astype(np.float64) for v in vectors], [1.0] * 4, config, rng=rng)
    # Assert
    index = shared_index(50, 10, 3)
    steps = np.rint(result.total * scale).astype(np.int64)
    assert np.array_equal(steps, np.rint(np.sum(vectors, axis=0)[index] * scale).astype(np.int64))


def _arr(values: np.ndarray) -> Array:
    values = np.ascontiguousarray(values)
    return Array(dtype=str(values.dtype), shape=tuple(values.shape), stype="numpy.ndarray", data=npy_bytes(values))


def _codes(scale: float, codes: bytes = b"\0\0") -> Array:
    return _arr(np.frombuffer(np.array([scale], np.float32).tobytes() + codes, dtype=np.uint8))


def _gaps(*tokens: int) -> Array:
    return _arr(np.array(tokens, dtype=np.uint8))


@pytest.mark.parametrize("arrays, why", [
    ({"values": _arr(np.zeros(3, np.float32))}, "expected"),
    ({"codes": _codes(np.nan), "index": _gaps(0, 1)}, "scale"),
    ({"codes": _codes(np.inf), "index": _gaps(0, 1)}, "scale"),
    ({"codes": _codes(-1.0), "index": _gaps(0, 1)}, "scale"),
    ({"codes": _codes(1.0), "index": _gaps(5, 0)}, "strictly increasing"),  # a repeated coordinate
    ({"codes": _codes(1.0), "index": _gaps(1, 98)}, "below 20"),
    ({"codes": _codes(1.0), "index": _gaps(1, 2, 3)}, "expected 2"),
    ({"codes": _codes(1.0), "index": _gaps(1, 255)}, "expected 2"),  # ends inside a gap
    ({"codes": _codes(1.0), "index": _arr(np.array([1, 2], np.uint32))}, "uint8"),
    ({"codes": _arr(np.zeros(6, np.float32)), "index": _gaps(1, 2)}, "uint8"),
    ({"codes": _codes(1.0, b"\0" * 5), "index": _gaps(1, 2)}, "bytes"),
    ({"codes": _codes(1.0), "index": _gaps(1, 2), "delta": _codes(1.0)}, "expected"),
])
def test_decoder_refuses_malformed_payloads(arrays, why):
    # top-k 10% of 20 values = 2, in 8 bits: codes (the scale's 4 bytes, then 2 bytes) and the index
    with pytest.raises(UpdateRejected, match=why):
        Codec(topk=0.1, bits=8).decode(arrays, 20)


@given(payload=st.dictionaries(st.sampled_from(["values", "codes", "index", "delta"]),
                               st.binary(max_size=64), max_size=4),
       bits=st.sampled_from([1, 3, 8, 16, 32]), topk=st.sampled_from([0.0, 0.1, 1.0]))
@settings(max_examples=150, deadline=None)
def test_decoder_never_raises_anything_but_a_rejection(payload, bits, topk):
    arrays = {k: Array(dtype="uint8", shape=(len(v),), stype="numpy.ndarray", data=v) for k, v in payload.items()}
    try:
        out = Codec(bits=bits, topk=topk).decode(arrays, 20, max_bytes=1000)
    except UpdateRejected:
        return
    assert out.shape == (20,) and np.isfinite(out).all()


def test_decoder_refuses_an_oversized_payload():
    codec = Codec(bits=8)
    arrays = codec.encode(np.ones(1000, np.float32), np.random.default_rng(0))
    with pytest.raises(UpdateRejected, match="byte limit"):
        codec.decode(arrays, 1000, max_bytes=500)


def test_broadcast_16_bits_relative_error_and_8_bits_step_bound():
    # Prepare
    layout = ParamLayout.of({"w": (30, 10), "b": (10,)})
    params = np.random.default_rng(6).normal(size=layout.size).astype(np.float32)
    # Execute
    half = Broadcast(16).roundtrip(params, layout)
    eight = Broadcast(8).roundtrip(params, layout)
    # Assert: float16 keeps 11 significant bits; 8-bit codes are within half a step of each tensor's range
    assert np.all(np.abs(half - params) <= np.abs(params) * 2.0**-11 + 1e-7)
    w, b = params[:300], params[300:]
    assert np.all(np.abs(eight[:300] - w) <= (w.max() - w.min()) / 510 * (1 + 1e-5))
    assert np.all(np.abs(eight[300:] - b) <= (b.max() - b.min()) / 510 * (1 + 1e-5))


def test_broadcast_8_bits_server_and_client_hold_the_same_model():
    layout = ParamLayout.of({"w": (7, 3), "c": (4,)})
    params = np.random.default_rng(7).normal(size=layout.size).astype(np.float32)
    broadcast = Broadcast(8)
    assert np.array_equal(broadcast.roundtrip(params, layout), broadcast.decode(broadcast.encode(params, layout),
                                                                                layout))


def test_broadcast_16_bits_refuses_values_beyond_float16():
    with pytest.raises(ValueError, match="float16"):
        Broadcast(16).encode(np.array([1e6], np.float32), ParamLayout.flat(1))


@pytest.mark.parametrize("kwargs, why", [
    ({"bits": 0}, "bits"), ({"bits": 17}, "bits"), ({"bits": True}, "bits"), ({"topk": 1.5}, "topk"),
    ({"randomk": -0.1}, "randomk"), ({"topk": 0.1, "randomk": 0.1}, "choose one"), ({"topk": float("nan")}, "topk"),
])
def test_codec_refuses_bad_settings(kwargs, why):
    with pytest.raises(ValueError, match=why):
        Codec(**kwargs)
