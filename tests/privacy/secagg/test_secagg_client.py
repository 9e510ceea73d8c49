"""Client steps: refusals, tampered and replayed shares, mask uniformity and freshness."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from privacy.secagg import SecAggConfig, SecAggCryptoError, SecAggProtocolError, ServerRound, Stage
from privacy.secagg.client import advertise_keys, masked_input, share_keys, unmask
from privacy.secagg.identity import ClientPolicy
from privacy.secagg.messages import MaskedInputRequest, UnmaskRequest
from privacy.secagg.state import state_from_bytes, state_to_bytes

SEMI = ClientPolicy("semi-honest")  # these rounds use t = 2 of 3-4: semi-honest only


def entropy_from(label: bytes):
    """Deterministic entropy (SHAKE-256 over a counter), for known-answer tests."""
    counter = {"i": 0}

    def draw(n: int) -> bytes:
        counter["i"] += 1
        return hashlib.shake_256(label + counter["i"].to_bytes(8, "big")).digest(n)

    return draw


def setup_round(n: int = 4, round_id: int = 1, label: bytes = b"k", config: SecAggConfig | None = None):
    """Run ADVERTISE_KEYS and SHARE_KEYS for clients 0..n-1; return what MASKED_INPUT needs."""
    entropy = entropy_from(label)
    config = config or SecAggConfig(threshold=2, threat_model="semi-honest")
    server = ServerRound(range(n), config, round_id=round_id, entropy=entropy)
    states = {}
    for node, setup in server.requests().items():
        states[node], reply = advertise_keys(node, setup, entropy, SEMI)
        server.accept(node, reply)
    server.close()
    for node, directory in server.requests().items():
        states[node], reply = share_keys(states[node], directory, entropy)
        server.accept(node, reply)
    server.close()
    return server, states, server.requests()


def test_one_masked_vector_alone_is_uniform_per_byte_lane():
    # Prepare: a constant input, so any structure left would show up.
    _, states, requests = setup_round(n=4)
    update = np.full(40_000, 0.25)

    # Execute
    _, masked = masked_input(states[0], requests[0], update, 1.0, np.random.default_rng(0))

    # Assert: chi-square of each byte lane over 256 bins; 347.7 is the
    # 1e-4 upper quantile of chi2(255). The entropy is fixed, so this is a
    # known answer, not a flaky test.
    lanes = masked.vector.view(np.uint8).reshape(-1, 4)
    expected = lanes.shape[0] / 256
    for lane in lanes.T:
        chi2 = float((((np.bincount(lane, minlength=256) - expected) ** 2) / expected).sum())
        assert chi2 < 347.7


def test_the_uniformity_check_has_power():
    # The same statistic on the unmasked encoding fails by a mile.
    from privacy.secagg.quantize import Quantizer

    codes = Quantizer(32, 1.0, 4).encode(np.full(40_000, 0.25), 1.0, np.random.default_rng(0))
    lane = codes.view(np.uint8).reshape(-1, 4)[:, 3]
    expected = lane.shape[0] / 256
    assert float((((np.bincount(lane, minlength=256) - expected) ** 2) / expected).sum()) > 10_000


def _masked(round_id: int, label: bytes) -> np.ndarray:
    _, states, requests = setup_round(n=3, round_id=round_id, label=label)
    _, out = masked_input(states[1], requests[1], np.zeros(64), 1.0, np.random.default_rng(0))
    return out.vector


def test_masks_are_deterministic_per_key_and_differ_per_round():
    assert np.array_equal(_masked(1, b"k"), _masked(1, b"k"))
    assert np.mean(_masked(1, b"k") == _masked(2, b"k")) < 0.05


def test_a_tampered_share_is_rejected():
    _, states, requests = setup_round()
    share = requests[0].shares[0]
    bad = dataclasses.replace(share, ciphertext=share.ciphertext[:-1] + bytes([share.ciphertext[-1] ^ 1]))

    with pytest.raises(SecAggCryptoError):
        masked_input(states[0], MaskedInputRequest((bad,) + requests[0].shares[1:]),
                     np.zeros(8), 1.0, np.random.default_rng(0))


def test_a_replayed_share_is_rejected():
    _, states, requests = setup_round()
    first = requests[0].shares[0]

    with pytest.raises(SecAggProtocolError, match="replayed"):
        masked_input(states[0], MaskedInputRequest(requests[0].shares + (first,)),
                     np.zeros(8), 1.0, np.random.default_rng(0))


def test_a_share_replayed_from_another_round_is_rejected():
    _, states, requests = setup_round(round_id=2, label=b"k")
    _, _, old = setup_round(round_id=1, label=b"k")
    stale = [s for s in old[0].shares if s.sender == requests[0].shares[0].sender]

    with pytest.raises(SecAggCryptoError):
        masked_input(states[0], MaskedInputRequest(tuple(stale) + requests[0].shares[1:]),
                     np.zeros(8), 1.0, np.random.default_rng(0))


def test_a_misaddressed_share_is_rejected():
    _, states, requests = setup_round()

    with pytest.raises(SecAggProtocolError, match="misrouted"):
        masked_input(states[0], requests[1], np.zeros(8), 1.0, np.random.default_rng(0))


def _after_masked_input():
    _, states, requests = setup_round(n=4)
    state, _ = masked_input(states[0], requests[0], np.zeros(8), 1.0, np.random.default_rng(0))
    return state


def test_client_refuses_both_secrets_of_one_peer_in_one_request():
    state = _after_masked_input()

    with pytest.raises(SecAggProtocolError, match=r"refusing to reveal both secrets of \[2\]"):
        unmask(state, UnmaskRequest(survivors=(0, 1, 2), dropped=(2, 3)))


def test_client_refuses_both_secrets_of_one_peer_across_requests():
    state = _after_masked_input()
    state, reply = unmask(state, UnmaskRequest(survivors=(0, 1, 2), dropped=(3,)))

    with pytest.raises(SecAggProtocolError, match=r"both secrets of \[2\]"):
        unmask(state, UnmaskRequest(survivors=(0, 1), dropped=(2, 3)))
    assert [s.owner for s in reply.self_mask_shares] == [0, 1, 2]
    assert [s.owner for s in reply.mask_key_shares] == [3]


def test_client_refuses_to_be_declared_dropped_or_below_threshold():
    state = _after_masked_input()

    with pytest.raises(SecAggProtocolError, match="claims this client dropped"):
        unmask(state, UnmaskRequest(survivors=(1, 2), dropped=(0,)))
    with pytest.raises(SecAggProtocolError, match="only 1 survivors, threshold 2"):
        unmask(state, UnmaskRequest(survivors=(0,), dropped=(1, 2, 3)))


def test_out_of_order_requests_are_refused():
    _, states, requests = setup_round()

    with pytest.raises(SecAggProtocolError, match="out-of-order"):
        unmask(states[0], UnmaskRequest(survivors=(0, 1), dropped=()))


def test_client_state_round_trips_through_bytes():
    state = _after_masked_input()
    state, _ = unmask(state, UnmaskRequest(survivors=(0, 1, 2), dropped=(3,)))

    assert state_from_bytes(state_to_bytes(state)) == state


def test_server_rejects_a_reply_that_skips_a_neighbour():
    entropy = entropy_from(b"s")
    server = ServerRound(range(3), SecAggConfig(threshold=2, threat_model="semi-honest"), round_id=1, entropy=entropy)
    states = {}
    for node, setup in server.requests().items():
        states[node], reply = advertise_keys(node, setup, entropy, SEMI)
        server.accept(node, reply)
    server.close()
    directory = server.requests()[0]
    _, reply = share_keys(states[0], directory, entropy)

    with pytest.raises(SecAggProtocolError, match="not addressed to its neighbours"):
        server.accept(0, dataclasses.replace(reply, shares=reply.shares[:1]))
    assert server.stage is Stage.SHARE_KEYS


def test_server_rejects_a_replayed_key_advertisement():
    entropy = entropy_from(b"r")
    server = ServerRound(range(3), SecAggConfig(threshold=2, threat_model="semi-honest"), round_id=1, entropy=entropy)
    setup = server.requests()[0]
    _, reply = advertise_keys(0, setup, entropy, SEMI)
    server.accept(0, reply)

    with pytest.raises(SecAggProtocolError, match="reused public key"):
        server.accept(1, reply)
    with pytest.raises(SecAggProtocolError, match="duplicate reply"):
        server.accept(0, reply)
