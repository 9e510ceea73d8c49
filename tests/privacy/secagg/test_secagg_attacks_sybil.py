"""Attacks on secure aggregation through identities, run against the real client code.

Written from the descriptions in issue 13, not from the protocol code:

- the Sybil server: it adds 11 fake clients of its own to 10 real ones, so
  it holds a majority of every share;
- key substitution: the server swaps a real client's advertised keys for
  its own.

Each attack is first shown to *work* where the protection is off (no
signatures), so the attack code has power, then shown to recover nothing
with the shipped settings (enrolled identity keys, signed advertisements).
The lying server is in ``test_secagg_attacks.py``; the attacking server
itself in ``secagg_support.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from secagg_support import TARGET, Attacker, enrolled, recover, shipped_config

from privacy.secagg import InsufficientSharesError, SecAggConfig, SecAggCryptoError, Stage
from privacy.secagg.identity import ClientPolicy, IdentityDirectory, enrol, sign
from privacy.secagg.messages import KeyDirectory, MaskedInput, PublicKeys, ShareKeysReply
from privacy.secagg.shamir import combine
from privacy.secagg.state import ClientState


# -- the Sybil server ---------------------------------------------------------------
def sybil_round(config: SecAggConfig, real: dict[int, ClientPolicy], fakes: dict[int, ClientPolicy]) -> Attacker:
    """Real clients and the server's own fakes, which run the client code under the server's policies."""
    return Attacker(config, sorted(real) + sorted(fakes), {**real, **fakes})


def server_enrolment(true: IdentityDirectory, fakes: list[int]) -> dict[int, ClientPolicy]:
    """The fakes' view: the true enrolment of the real clients plus keys the server made for its fakes."""
    keys, own = enrol(fakes)
    merged = IdentityDirectory.from_json(json.dumps({**json.loads(true.to_json()), **json.loads(own.to_json())}))
    return {f: ClientPolicy("malicious", keys[f], merged) for f in fakes}


def fake_shares_of_real_secrets(attacker: Attacker, fakes: list[int], target: int) -> tuple[dict, dict]:
    """The shares of ``target``'s secrets that reached the fakes (the server decrypts them: it owns them)."""
    held = [(attacker.server.setup.x_of(f), attacker.states[f].held.get(target)) for f in fakes if f in attacker.states]
    pairs = [(x, h) for x, h in held if h is not None]
    return {x: h[0] for x, h in pairs}, {x: h[1] for x, h in pairs}


def test_sybil_attack_works_without_signatures():
    # Prepare: semi-honest clients, a strict majority t = 11 of 21 (power check of the attack code)
    real, fakes = list(range(10)), list(range(100, 111))
    config = SecAggConfig(max_weight=1000.0, clip_range=8.0, threat_model="semi-honest")
    semi = ClientPolicy("semi-honest")
    attacker = sybil_round(config, dict.fromkeys(real, semi), dict.fromkeys(fakes, semi))

    # Execute: an honest-looking round; the fakes' shares are the server's
    for _ in range(3):
        replies = attacker.honest_stage()
    masked = {u: r.vector for u, r in replies.items() if isinstance(r, MaskedInput)}
    attacker.masked = {u: v.copy() for u, v in masked.items()}
    b_points, s_points = fake_shares_of_real_secrets(attacker, fakes, TARGET)

    # Assert: 11 shares of both secrets: the real target's update comes back
    assert attacker.server.threshold == 11 and len(b_points) == 11
    assert np.abs(recover(attacker, TARGET, b_points, s_points) - attacker.updates[TARGET]).max() < 1e-3


def test_sybil_clients_outside_the_enrolment_are_refused_at_setup():
    # Prepare: 10 enrolled real clients, 11 unenrolled fakes; t = 11 of 21 is a majority
    real, fakes = list(range(10)), list(range(100, 111))
    policies = enrolled(real)
    attacker = sybil_round(SecAggConfig(max_weight=1000.0), policies,
                           server_enrolment(policies[0].directory, fakes))  # type: ignore[arg-type]

    # Execute
    attacker.honest_stage()

    # Assert: no real client advertised keys, so no share of any real secret will ever exist
    assert set(attacker.refused) == set(real)
    assert all("missing from the enrolment directory" in str(attacker.refused[u]) for u in real)
    assert not any(isinstance(attacker.states.get(u), ClientState) for u in real)


def test_sybil_clients_with_forged_signatures_get_no_share():
    # Prepare: the directory enrols all 21 ids, but the 11 fakes' identity keys belong to
    # others (unsampled real devices); the server signs their advertisements with its own keys
    real, fakes = list(range(10)), list(range(100, 111))
    keys, directory = enrol(real + fakes)
    policies = {u: ClientPolicy("malicious", keys[u], directory) for u in real}
    attacker = sybil_round(SecAggConfig(max_weight=1000.0), policies, server_enrolment(directory, fakes))

    # Execute: ADVERTISE_KEYS (real clients) then SHARE_KEYS
    attacker.honest_stage()
    replies = attacker.honest_stage()

    # Assert: every real client's signature check failed (opaque), no real share was sent
    assert {u: type(attacker.refused.get(u)) for u in real} == {u: SecAggCryptoError for u in real}
    assert not any(isinstance(replies.get(u), ShareKeysReply) for u in real)
    b_points, s_points = fake_shares_of_real_secrets(attacker, fakes, TARGET)
    assert b_points == s_points == {}
    with pytest.raises(InsufficientSharesError):
        combine(b_points, attacker.server.threshold)


# -- signed identities --------------------------------------------------------------
def test_a_substituted_key_for_a_real_client_fails_the_signature_check():
    # Prepare: an honest advertisement round, then the server swaps client 3's keys for its own
    clients = list(range(10))
    attacker = Attacker(shipped_config(), clients, enrolled(clients))
    attacker.honest_stage()
    directory = attacker.server.requests()[0]
    assert isinstance(directory, KeyDirectory)
    mine = X25519PrivateKey.generate().public_key().public_bytes_raw()
    entries = tuple(PublicKeys(e.owner, mine, e.mask) if e.owner == 3 else e for e in directory.entries)
    swapped = KeyDirectory(entries, directory.signatures)

    # Execute
    replies = [attacker.ask(u, swapped) for u in clients if u != 3]

    # Assert: everyone who would encrypt shares to the substituted key refuses
    assert replies == [None] * 9
    assert all(isinstance(attacker.refused[u], SecAggCryptoError) for u in clients if u != 3)


def test_identity_directory_round_trips_and_rejects_wrong_keys():
    keys, directory = enrol([1, 2])
    again = IdentityDirectory.from_json(directory.to_json())
    message = b"m"

    assert again.verify(1, sign(keys[1], message), message)
    assert not again.verify(2, sign(keys[1], message), message)
    assert not again.verify(3, sign(keys[1], message), message)
    assert not again.verify(1, sign(keys[1], message), b"n")


def test_the_stage_order_of_a_malicious_round():
    clients = list(range(4))
    attacker = Attacker(SecAggConfig(max_weight=1.0), clients, enrolled(clients))
    stages = []
    while attacker.server.stage is not None:
        stages.append(attacker.server.stage)
        attacker.honest_stage()

    assert stages == list(Stage)
    assert not attacker.refused
    assert isinstance(attacker.server.result()[0], np.ndarray)


def test_requests_of_a_malicious_round_carry_signatures():
    clients = list(range(4))
    attacker = Attacker(SecAggConfig(max_weight=1.0), clients, enrolled(clients))
    attacker.honest_stage()
    directory = attacker.server.requests()[0]

    assert isinstance(directory, KeyDirectory) and len(directory.signatures) == 4
    assert all(len(s) == 64 for s in directory.signatures)
