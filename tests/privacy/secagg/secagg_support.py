"""The attacking server shared by the secure-aggregation attack tests.

Written from the descriptions in issue 13, not from the protocol code: an
:class:`Attacker` runs the honest server stages over the real client code,
keeps every message, and then deviates; :func:`recover` strips every mask off
one client's masked input from shares of both of its secrets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from privacy.secagg import SecAggConfig, SecAggCryptoError, SecAggProtocolError
from privacy.secagg.client import client_step
from privacy.secagg.codec import setup_digest
from privacy.secagg.identity import ClientPolicy, enrol
from privacy.secagg.keys import agree, pair_mask_key, self_mask_key, session_digest
from privacy.secagg.messages import MaskedInput
from privacy.secagg.prg import MaskExpander
from privacy.secagg.quantize import Quantizer
from privacy.secagg.server import ServerRound
from privacy.secagg.shamir import combine
from privacy.secagg.state import ClientState
from privacy.secagg.train import config_from_spec
from scenarios.schema import load_scenario
from tests.conftest import REPO

__all__ = ["TARGET", "Attacker", "enrolled", "recover", "shipped_config"]

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


def enrolled(clients: list[int], threat_model: str = "malicious") -> dict[int, ClientPolicy]:
    keys, directory = enrol(clients)
    return {u: ClientPolicy(threat_model, keys[u], directory) for u in clients}
