"""Attacks on secure aggregation by a lying server, run against the real client code.

Written from the descriptions in issue 13, not from the protocol code:

- the lying server: at unmask it tells half of the clients that ``u``
  survived (they reveal shares of ``u``'s self-mask seed) and the other half
  that ``u`` dropped (they reveal shares of ``u``'s mask key), then rebuilds
  both secrets and strips every mask off ``u``'s masked input;
- the same lie helped by colluding clients, up to the documented bound.

Each attack is first shown to *work* where the protection is off (the old
``threshold = 0.5`` semi-honest setting; no signatures), so the attack code
has power, then shown to recover nothing with the shipped settings. The
Sybil server is in ``test_secagg_attacks_sybil.py``; the attacking server
itself in ``secagg_support.py``.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from secagg_support import TARGET, Attacker, enrolled, recover, shipped_config

from privacy.secagg import (
    InsufficientSharesError,
    SecAggConfig,
    SecAggConfigError,
    SecAggCryptoError,
    SecAggProtocolError,
)
from privacy.secagg.client import client_step
from privacy.secagg.identity import ClientPolicy, sign, survivors_message
from privacy.secagg.messages import (
    ConsistencyReply,
    ConsistencyRequest,
    SignedSurvivors,
    UnmaskReply,
    UnmaskRequest,
)
from privacy.secagg.server import ServerRound


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


# -- colluding clients --------------------------------------------------------------
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
