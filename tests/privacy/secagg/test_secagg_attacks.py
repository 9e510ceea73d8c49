"""Attacks on secure aggregation by the server, run against the real client code.

Written from the descriptions in issue 13, not from the protocol code:

- the lying server: at unmask it tells half of the clients that ``u``
  survived (they reveal shares of ``u``'s self-mask seed) and the other half
  that ``u`` dropped (they reveal shares of ``u``'s mask key), then rebuilds
  both secrets and strips every mask off ``u``'s masked input;
- the Sybil server: it adds 11 fake clients of its own to 10 real ones, so
  it holds a majority of every share.

Each attack is first shown to *work* where the protection is off (the old
``threshold = 0.5`` semi-honest setting; no signatures), so the attack code
has power, then shown to recover nothing with the shipped settings.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from privacy.secagg import (
    InsufficientSharesError,
    SecAggConfig,
    SecAggConfigError,
    SecAggCryptoError,
    SecAggProtocolError,
    Stage,
)
from privacy.secagg.client import client_step
from privacy.secagg.codec import setup_digest
from privacy.secagg.fit import config_from_spec
from privacy.secagg.identity import ClientPolicy, IdentityDirectory, enrol, sign, survivors_message
from privacy.secagg.keys import agree, pair_mask_key, self_mask_key, session_digest
from privacy.secagg.messages import (
    ConsistencyReply,
    ConsistencyRequest,
    KeyDirectory,
    MaskedInput,
    PublicKeys,
    ShareKeysReply,
    SignedSurvivors,
    UnmaskReply,
    UnmaskRequest,
)
from privacy.secagg.prg import MaskExpander
from privacy.secagg.quantize import Quantizer
from privacy.secagg.server import ServerRound
from privacy.secagg.shamir import combine
from privacy.secagg.state import ClientState
from scenarios.schema import load_scenario
from tests.conftest import REPO

REFUSALS = (SecAggProtocolError, SecAggCryptoError)
D = 50
TARGET = 0


def shipped_config() -> SecAggConfig:
    """The protocol config the shipped ``scenarios/secagg.toml`` runs with."""
    return config_from_spec(load_scenario(REPO / "scenarios" / "secagg.toml").secagg)


@dataclass
class Attacker:
    """A server that runs the honest stages, keeps every message, and then deviates."""

    config: SecAggConfig
    clients: list[int]
    policies: dict[int, ClientPolicy]
    server: ServerRound = field(init=False)
    states: dict[int, ClientState] = field(default_factory=dict)
    masked: dict[int, np.ndarray] = field(default_factory=dict)
    refused: dict[int, Exception] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(5)
        self.updates = {u: rng.uniform(-1, 1, D) for u in self.clients}
        self.server = ServerRound(self.clients, self.config, round_id=1)

    def ask(self, node: int, request: object) -> object | None:
        """One real client step; a refusal is recorded and returns None."""
        try:
            state, reply = client_step(self.states.get(node), node, request, entropy=os.urandom,  # type: ignore[arg-type]
                                       rng=np.random.default_rng(node), policy=self.policies[node],
                                       train=lambda: (self.updates[node], 1.0))
        except REFUSALS as exc:
            self.refused[node] = exc
            return None
        self.states[node] = state
        return reply

    def honest_stage(self) -> dict[int, object]:
        """Run the server's current stage honestly over the real clients."""
        replies = {}
        for node, request in sorted(self.server.requests().items()):
            reply = self.ask(node, request)
            if reply is not None:
                self.server.accept(node, reply)  # type: ignore[arg-type]
                replies[node] = reply
        self.server.close()
        return replies

    def run_until_unmask(self) -> None:
        for _ in range(3):  # ADVERTISE_KEYS, SHARE_KEYS, MASKED_INPUT
            replies = self.honest_stage()
        self.masked = {u: r.vector.copy() for u, r in replies.items() if isinstance(r, MaskedInput)}
        assert len(self.masked) == len(self.clients)

    @property
    def session(self) -> bytes:
        setup = self.server.setup
        entries = tuple(self.server._keys[u] for u in sorted(self.server._keys))
        return session_digest(setup.round, setup_digest(setup), entries)


def recover(attacker: Attacker, target: int, b_points: dict[int, int], s_points: dict[int, int]) -> np.ndarray:
    """The attacker's unmasking of one client's input from both of its secrets."""
    setup, t, session = attacker.server.setup, attacker.server.threshold, attacker.session
    seed, mask_sk = combine(b_points, t), combine(s_points, t)  # raises below t
    y = attacker.masked[target].copy()
    length, key = y.shape[0], X25519PrivateKey.from_private_bytes(mask_sk)
    minus = [self_mask_key(seed, session, target, length, setup.bits)]
    plus = []
    for v in attacker.clients:
        if v == target:
            continue
        pair = pair_mask_key(agree(key, attacker.server._keys[v].mask), session, target, v, length, setup.bits)
        (minus if target < v else plus).append(pair)
    MaskExpander(length, setup.bits).add_all(y, plus, minus)
    total, weight = Quantizer(setup.bits, setup.clip_range, len(setup.participants)).decode(y)
    return total / weight


def lie_at_unmask(attacker: Attacker, group_a: list[int], group_b: list[int],
                  signatures: dict[tuple[int, ...], list[SignedSurvivors]]) -> tuple[dict[int, int], dict[int, int]]:
    """Tell ``group_a`` that TARGET survived and ``group_b`` that it dropped; collect the shares."""
    everyone = tuple(attacker.clients)
    without = tuple(u for u in everyone if u != TARGET)
    b_points: dict[int, int] = {}
    s_points: dict[int, int] = {}
    for node in group_a + group_b:
        told = everyone if node in group_a else without
        request = UnmaskRequest(told, () if node in group_a else (TARGET,), tuple(signatures.get(told, ())))
        reply = attacker.ask(node, request)
        if isinstance(reply, UnmaskReply):
            x = attacker.server.setup.x_of(node)
            for points, shares in ((b_points, reply.self_mask_shares), (s_points, reply.mask_key_shares)):
                points.update((x, s.value) for s in shares if s.owner == TARGET)
    return b_points, s_points


def enrolled(clients: list[int], threat_model: str = "malicious") -> dict[int, ClientPolicy]:
    keys, directory = enrol(clients)
    return {u: ClientPolicy(threat_model, keys[u], directory) for u in clients}


# -- the lying server ---------------------------------------------------------------
def test_lying_server_attack_works_with_the_old_half_threshold():
    # Prepare: the old shipped setting, t = 5 of 10, semi-honest (power check of the attack code)
    config = SecAggConfig(threshold=0.5, max_weight=1000.0, clip_range=8.0, threat_model="semi-honest")
    clients = list(range(10))
    attacker = Attacker(config, clients, {u: ClientPolicy("semi-honest") for u in clients})
    attacker.run_until_unmask()

    # Execute: five clients hear that TARGET survived, five that it dropped
    b_points, s_points = lie_at_unmask(attacker, clients[:5], clients[5:], {})

    # Assert: t shares of both secrets, and the target's update comes back
    assert attacker.server.threshold == 5 and len(b_points) == len(s_points) == 5
    assert np.abs(recover(attacker, TARGET, b_points, s_points) - attacker.updates[TARGET]).max() < 1e-3


def test_lying_server_recovers_nothing_with_the_shipped_scenario():
    # Prepare: the shipped scenario's settings (malicious model, majority t = 6), 10 clients,
    # complete graph, every client enrolled
    config = shipped_config()
    clients = list(range(10))
    attacker = Attacker(config, clients, enrolled(clients))
    attacker.run_until_unmask()
    assert (config.threat_model, config.graph, attacker.server.threshold) == ("malicious", "complete", 6)
    group_a, group_b = clients[:5], clients[5:]  # TARGET = 0 is in group_a
    everyone, without = tuple(clients), tuple(clients[1:])

    # Execute: the consistency round, lying: group_a hears U3 = everyone, group_b U3 = everyone - {0}
    signatures: dict[tuple[int, ...], list[SignedSurvivors]] = {everyone: [], without: []}
    for node in clients:
        told = everyone if node in group_a else without
        reply = attacker.ask(node, ConsistencyRequest(told))
        assert isinstance(reply, ConsistencyReply)
        signatures[told].append(SignedSurvivors(node, reply.signature))
    b_points, s_points = lie_at_unmask(attacker, group_a, group_b, signatures)

    # Assert: every client refused before revealing a single share: 5 signatures < t = 6
    assert set(attacker.refused) == set(clients)
    assert all("confirmed the survivors, threshold 6" in str(e) for e in attacker.refused.values())
    assert b_points == {} and s_points == {}
    with pytest.raises(InsufficientSharesError):
        recover(attacker, TARGET, b_points, s_points)


def test_lying_server_cannot_pass_off_the_other_groups_signatures():
    # Prepare: as above; the server now forwards all ten signatures to everyone
    clients = list(range(10))
    attacker = Attacker(shipped_config(), clients, enrolled(clients))
    attacker.run_until_unmask()
    everyone, without = tuple(clients), tuple(clients[1:])
    mixed = []
    for node in clients:
        reply = attacker.ask(node, ConsistencyRequest(everyone if node < 5 else without))
        mixed.append(SignedSurvivors(node, reply.signature))  # type: ignore[union-attr]

    # Execute
    b_points, s_points = lie_at_unmask(attacker, clients[:5], clients[5:], {everyone: mixed, without: mixed})

    # Assert: a signature of the other set does not verify (opaque refusal); group b also sees
    # a signer outside the set it signed; nothing is revealed
    assert all(isinstance(attacker.refused[u], SecAggCryptoError) for u in clients[:5])
    assert set(attacker.refused) == set(clients) and b_points == s_points == {}


def test_lying_server_skipping_the_consistency_round_is_refused():
    clients = list(range(10))
    attacker = Attacker(shipped_config(), clients, enrolled(clients))
    attacker.run_until_unmask()

    b_points, s_points = lie_at_unmask(attacker, clients[:5], clients[5:], {})

    assert all("out-of-order" in str(e) for e in attacker.refused.values())
    assert set(attacker.refused) == set(clients) and b_points == s_points == {}


def test_majority_threshold_alone_defeats_the_lie_in_the_semi_honest_model():
    # Prepare: no consistency round, but the strict majority t = 6 of 10
    config = SecAggConfig(max_weight=1000.0, clip_range=8.0, threat_model="semi-honest")
    clients = list(range(10))
    attacker = Attacker(config, clients, {u: ClientPolicy("semi-honest") for u in clients})
    attacker.run_until_unmask()

    # Execute: the best split, five and five (each client reveals only one secret of TARGET)
    b_points, s_points = lie_at_unmask(attacker, clients[:5], clients[5:], {})

    # Assert: the shares were revealed, but fewer than t of each secret
    assert attacker.server.threshold == 6 and len(b_points) == len(s_points) == 5
    with pytest.raises(InsufficientSharesError):
        recover(attacker, TARGET, b_points, s_points)


@pytest.mark.parametrize("m", range(4, 12))
def test_a_client_refuses_a_setup_whose_threshold_is_no_majority(m):
    # Prepare: a setup for m clients (complete graph) with t = floor(m/2), the largest non-majority
    t = m // 2
    setup = ServerRound(range(m), SecAggConfig(threshold=t, threat_model="semi-honest"), round_id=1).setup
    policies = enrolled(list(range(m)))

    # Execute / Assert: a malicious-model client refuses it however the setup is labelled ...
    for label in ("semi-honest", "malicious"):
        forged = dataclasses.replace(setup, threat_model=label)
        with pytest.raises(SecAggProtocolError):
            client_step(None, 0, forged, entropy=os.urandom, rng=np.random.default_rng(0), policy=policies[0])
    # ... a client whose own policy is semi-honest takes it, and the server's config needs the same opt-in
    client_step(None, 0, setup, entropy=os.urandom, rng=np.random.default_rng(0), policy=ClientPolicy("semi-honest"))
    with pytest.raises(SecAggConfigError, match="not a strict majority"):
        SecAggConfig(threshold=t).threshold_for(m)
    assert SecAggConfig(threshold=t + 1).threshold_for(m) == t + 1


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


@pytest.mark.parametrize(("colluders", "recovered"), [((9,), False), ((8, 9), True)])
def test_colluding_clients_and_the_documented_bound(colluders, recovered):
    # Prepare: shipped settings (t = 6 of m = 10); colluders hand the server their identity keys
    # and shares. docs/secagg.md: safe while 2t > m + c, so c = 1 is safe and c = 2 is not.
    clients = list(range(10))
    attacker = Attacker(shipped_config(), clients, enrolled(clients))
    attacker.run_until_unmask()
    honest = [u for u in clients if u not in colluders]
    split = 5 if len(colluders) == 1 else 4  # the best split for the server: both groups near t
    group_a, group_b = honest[:split], honest[split:]  # TARGET = 0 is in group_a
    everyone, without = tuple(clients), tuple(clients[1:])
    signatures: dict[tuple[int, ...], list[SignedSurvivors]] = {everyone: [], without: []}
    for node in group_a + group_b:
        told = everyone if node in group_a else without
        signatures[told].append(SignedSurvivors(node, attacker.ask(node, ConsistencyRequest(told)).signature))
    for c in colluders:  # a colluder signs both sets
        for told in (everyone, without):
            message = survivors_message(attacker.session, told)
            signatures[told].append(SignedSurvivors(c, sign(attacker.policies[c].identity, message)))

    # Execute: the lie, plus the colluders' own shares of TARGET's two secrets
    b_points, s_points = lie_at_unmask(attacker, group_a, group_b, signatures)
    for c in colluders:
        b_share, s_share = attacker.states[c].held[TARGET]
        b_points[attacker.server.setup.x_of(c)] = b_share
        s_points[attacker.server.setup.x_of(c)] = s_share

    # Assert
    if recovered:
        assert np.abs(recover(attacker, TARGET, b_points, s_points) - attacker.updates[TARGET]).max() < 1e-3
    else:
        assert set(attacker.refused) == set(group_b) and len(s_points) == 1
        with pytest.raises(InsufficientSharesError):
            recover(attacker, TARGET, b_points, s_points)
