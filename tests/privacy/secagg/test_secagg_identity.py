"""Identities and the consistency check: known answers, every threshold subset, node configs."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from privacy.secagg import SecAggConfig, SecAggConfigError, SecAggProtocolError, ServerRound, Stage
from privacy.secagg.client import client_step, unmask
from privacy.secagg.codec import decode, encode
from privacy.secagg.identity import (
    ClientPolicy,
    IdentityDirectory,
    enrol,
    node_config,
    policy_from_node_config,
    sign,
    survivors_message,
)
from privacy.secagg.messages import (
    ConsistencyReply,
    ConsistencyRequest,
    KeyAdvertisement,
    KeyDirectory,
    SignedSurvivors,
    UnmaskRequest,
)
from privacy.secagg.state import state_from_bytes, state_to_bytes

# RFC 8032, section 7.1, TEST 1 (empty message)
RFC_SECRET = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC_PUBLIC = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC_SIGNATURE = bytes.fromhex(
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
)


def test_signatures_match_rfc_8032_test_1():
    directory = IdentityDirectory({7: RFC_PUBLIC})

    assert sign(RFC_SECRET, b"") == RFC_SIGNATURE
    assert directory.verify(7, RFC_SIGNATURE, b"")
    assert not directory.verify(7, RFC_SIGNATURE[:-1] + b"\x0a", b"")


def test_survivor_message_is_sorted_and_bound_to_the_session_by_hand():
    message = survivors_message(b"S" * 32, [3, 1])

    assert message == b"quorum/secagg/v1/survivors" + b"S" * 32 + bytes.fromhex(
        "00000002" "0000000000000001" "0000000000000003")


def test_node_config_round_trips_into_a_policy():
    configs = node_config([1, 2], "malicious", entropy=lambda n: b"\x01" * n)

    policy = policy_from_node_config(configs[2])

    assert policy.threat_model == "malicious" and policy.identity == b"\x01" * 32
    assert policy.directory is not None and 1 in policy.directory and 3 not in policy.directory
    assert policy_from_node_config({}) == ClientPolicy()  # unset: malicious, no keys: refuses rounds
    with pytest.raises(SecAggConfigError, match="threat_model"):
        policy_from_node_config({"secagg-threat-model": "trusting"})


def test_directory_file_and_malformed_directories(tmp_path):
    _, directory = enrol([5])
    path = tmp_path / "directory.json"
    path.write_text(directory.to_json())

    policy = policy_from_node_config({"secagg-directory": str(path), "secagg-threat-model": "malicious"})

    assert policy.directory is not None and 5 in policy.directory
    with pytest.raises(SecAggConfigError, match="malformed enrolment directory"):
        IdentityDirectory.from_json('{"5": "zz"}')


def test_new_messages_round_trip_through_the_codec():
    for message in (KeyAdvertisement(b"c" * 32, b"m" * 32, b"s" * 64), ConsistencyRequest((1, 4, 9)),
                    ConsistencyReply(b"x" * 64), UnmaskRequest((1, 2), (3,), (SignedSurvivors(1, b"y" * 64),))):
        assert decode(encode(message), type(message)) == message


def consistent_round(n: int = 5):
    """A malicious-model round over real clients, run up to and through CONSISTENCY_CHECK."""
    keys, directory = enrol(range(n))
    policies = {u: ClientPolicy("malicious", keys[u], directory) for u in range(n)}
    server = ServerRound(range(n), SecAggConfig(max_weight=1.0), round_id=4)
    states, signed = {}, {}
    while server.stage is not Stage.UNMASK:
        for node, request in server.requests().items():
            states[node], reply = client_step(states.get(node), node, request, entropy=os.urandom,
                                              rng=np.random.default_rng(0), policy=policies[node],
                                              train=lambda: (np.zeros(3), 1.0))
            if isinstance(reply, ConsistencyReply):
                signed[node] = SignedSurvivors(node, reply.signature)
            server.accept(node, reply)
        server.close()
    return server, states, signed, policies


def test_consistency_check_over_every_signer_subset():
    # Prepare: n = 5, t = 3: client 0 with every subset of the five survivor signatures
    server, states, signed, policies = consistent_round()
    everyone = tuple(range(5))
    assert server.threshold == 3

    # Execute / Assert: reveals with any t or more signers, refuses with fewer
    for size in range(6):
        for subset in itertools.combinations(everyone, size):
            request = UnmaskRequest(everyone, (), tuple(signed[v] for v in subset))
            if size >= 3:
                _, reply = unmask(states[0], request, policies[0])
                assert [s.owner for s in reply.self_mask_shares] == list(everyone)
            else:
                with pytest.raises(SecAggProtocolError, match=f"{size} neighbours confirmed"):
                    unmask(states[0], request, policies[0])


def test_unmask_must_follow_the_signed_survivor_set():
    server, states, signed, policies = consistent_round()
    sigs = tuple(signed.values())

    with pytest.raises(SecAggProtocolError, match="contradicts the survivor set"):
        unmask(states[0], UnmaskRequest((0, 1, 2, 3), (4,), sigs), policies[0])


def test_client_state_with_a_signed_survivor_set_round_trips():
    _, states, _, _ = consistent_round()

    assert states[1].consistency == (0, 1, 2, 3, 4)
    assert state_from_bytes(state_to_bytes(states[1])) == states[1]


def test_a_second_consistency_request_is_refused():
    server, states, _, policies = consistent_round()

    with pytest.raises(SecAggProtocolError, match="out-of-order"):
        client_step(states[2], 2, ConsistencyRequest((0, 1, 2)), entropy=os.urandom,
                    rng=np.random.default_rng(0), policy=policies[2])


def test_server_with_the_directory_drops_a_badly_signed_advertisement():
    keys, directory = enrol(range(3))
    server = ServerRound(range(3), SecAggConfig(max_weight=1.0), round_id=1, directory=directory)
    setup = server.requests()[0]
    _, good = client_step(None, 0, setup, entropy=os.urandom, rng=np.random.default_rng(0),
                          policy=ClientPolicy("malicious", keys[0], directory))

    with pytest.raises(SecAggProtocolError, match="does not verify"):
        server.accept(1, good)  # client 0's signature presented as client 1's
    assert isinstance(server.requests()[0], type(setup)) and not isinstance(setup, KeyDirectory)
