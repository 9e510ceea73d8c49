"""The client side of the protocol as pure steps: state in, new state and reply out.

Follows Bonawitz et al., CCS 2017, Fig. 4 (client rounds 0-4), on the
neighbour graph of Bell et al., CCS 2020. In a ``"malicious"`` round (the
actively secure variant, Sec. 6) key advertisements are signed with enrolled
identity keys and checked against the enrolment directory, and no share is
revealed before ``t`` neighbours have signed the same survivor set. What a
client accepts is its own :class:`~privacy.secagg.identity.ClientPolicy`,
never the server's word. A client that sees the server (or a peer) deviate
raises :class:`SecAggProtocolError` or :class:`SecAggCryptoError` and sends
nothing; to the server that is a dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from privacy.dp.discrete import GridNoise
from privacy.secagg.aead import open_share, seal_share, share_aad
from privacy.secagg.codec import setup_digest
from privacy.secagg.config import is_majority
from privacy.secagg.errors import SecAggCryptoError, SecAggProtocolError
from privacy.secagg.graph import neighbours
from privacy.secagg.identity import (
    MALICIOUS,
    ClientPolicy,
    IdentityDirectory,
    advertisement_message,
    sign,
    survivors_message,
)
from privacy.secagg.keys import (
    PublicKeys,
    agree,
    channel_keys,
    generate_keypair,
    pair_mask_key,
    self_mask_commitment,
    self_mask_key,
    session_digest,
)
from privacy.secagg.messages import (
    ConsistencyReply,
    ConsistencyRequest,
    EncryptedShare,
    KeyAdvertisement,
    KeyDirectory,
    MaskedInput,
    MaskedInputRequest,
    Reply,
    Request,
    RevealedShare,
    RoundSetup,
    ShareKeysReply,
    UnmaskReply,
    UnmaskRequest,
)
from privacy.secagg.prg import RING_BITS, MaskExpander
from privacy.secagg.quantize import Quantizer
from privacy.secagg.shamir import SHARE_BYTES, split
from privacy.secagg.stage import Stage
from privacy.secagg.state import ClientState

__all__ = [
    "Trainer",
    "advertise_keys",
    "client_step",
    "consistency_check",
    "masked_input",
    "normalised_weight",
    "share_keys",
    "unmask",
]

Entropy = Callable[[int], bytes]
#: Trains for the masked-input stage: ``(update, weight)``, or ``(update, weight, noise)`` with the
#: client's share of the distributed discrete Gaussian (``privacy.dp.discrete.GridNoise``) to add on the grid.
Trainer = Callable[[], tuple[np.ndarray, float] | tuple[np.ndarray, float, GridNoise | None]]
_STRICT = ClientPolicy()


def _expect(state: ClientState, *allowed: Stage) -> None:
    if state.stage not in allowed:
        raise SecAggProtocolError(
            f"client {state.node}: out-of-order request after stage '{state.stage.value}'"
        )


def _enrolment(node: int, policy: ClientPolicy) -> tuple[bytes, IdentityDirectory]:
    if policy.identity is None or policy.directory is None:
        raise SecAggProtocolError(f"client {node}: no identity key or enrolment directory")
    return policy.identity, policy.directory


def _check_threat_model(node: int, setup: RoundSetup, policy: ClientPolicy) -> None:
    """Refuse a round the client's own policy forbids: no downgrade, and a strict majority unless it allows less."""
    if policy.threat_model == MALICIOUS and setup.threat_model != MALICIOUS:
        raise SecAggProtocolError(f"client {node}: refusing a round without signed keys")
    strict = MALICIOUS in (policy.threat_model, setup.threat_model)
    if strict and not is_majority(setup.threshold, setup.degree + 1):
        raise SecAggProtocolError(
            f"client {node}: threshold {setup.threshold} is no strict majority of {setup.degree + 1}"
        )
    if setup.threat_model == MALICIOUS:
        _, directory = _enrolment(node, policy)
        if not all(u in directory for u in setup.participants):
            raise SecAggProtocolError(f"client {node}: participants missing from the enrolment directory")


def _check_setup(node: int, setup: RoundSetup, policy: ClientPolicy) -> None:
    ids = setup.participants
    if node not in ids or len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        raise SecAggProtocolError(f"client {node}: malformed participant list")
    if not 2 <= setup.threshold <= setup.degree + 1 or setup.degree >= len(ids):
        raise SecAggProtocolError(
            f"client {node}: threshold {setup.threshold} unsafe for degree {setup.degree}"
        )
    if setup.bits not in RING_BITS or not setup.clip_range > 0 or not setup.max_weight > 0:
        raise SecAggProtocolError(f"client {node}: malformed quantisation parameters")
    _check_threat_model(node, setup, policy)


def advertise_keys(node: int, setup: RoundSetup, entropy: Entropy,
                   policy: ClientPolicy = _STRICT) -> tuple[ClientState, KeyAdvertisement]:
    """Round 0: make two fresh X25519 key pairs and advertise the public halves (signed if malicious)."""
    _check_setup(node, setup, policy)
    cipher, mask = generate_keypair(entropy), generate_keypair(entropy)
    state = ClientState(node, setup, Stage.ADVERTISE_KEYS, cipher, mask)
    signature = b""
    if setup.threat_model == MALICIOUS:
        identity, _ = _enrolment(node, policy)
        signature = sign(identity, advertisement_message(setup_digest(setup), node, cipher.public, mask.public))
    return state, KeyAdvertisement(cipher.public, mask.public, signature)


def _check_directory(state: ClientState, directory: KeyDirectory) -> dict[int, PublicKeys]:
    entries = {e.owner: e for e in directory.entries}
    keys = [k for e in directory.entries for k in (e.cipher, e.mask)]
    mine = entries.get(state.node)
    if (len(entries) != len(directory.entries) or len(set(keys)) != len(keys)
            or not entries.keys() <= set(state.setup.participants) or mine is None
            or (mine.cipher, mine.mask) != (state.cipher_key.public, state.mask_key.public)):
        raise SecAggProtocolError(f"client {state.node}: inconsistent key directory")
    return entries


def _holders(state: ClientState, live: Mapping[int, PublicKeys]) -> list[int]:
    setup = state.setup
    around = neighbours(setup.graph, setup.participants, setup.degree, setup.graph_seed, state.node)
    holders = sorted((around & live.keys()) | {state.node})
    if len(holders) < setup.threshold:
        raise SecAggProtocolError(
            f"client {state.node}: {len(holders)} live share holders, threshold {setup.threshold}"
        )
    return holders


def _verify_advertisements(state: ClientState, directory: KeyDirectory, holders: list[int],
                           policy: ClientPolicy) -> None:
    """Every key this client will use is signed by its owner's enrolled identity (opaque if not)."""
    if state.setup.threat_model != MALICIOUS:
        return
    _, enrolled = _enrolment(state.node, policy)
    if len(directory.signatures) != len(directory.entries):
        raise SecAggCryptoError()
    signed = {e.owner: (e, sig) for e, sig in zip(directory.entries, directory.signatures, strict=True)}
    digest = setup_digest(state.setup)
    for v in holders:
        entry, signature = signed[v]
        if v != state.node and not enrolled.verify(
                v, signature, advertisement_message(digest, v, entry.cipher, entry.mask)):
            raise SecAggCryptoError()


def _x_coordinates(setup: RoundSetup, nodes: list[int]) -> list[int]:
    index = {u: i + 1 for i, u in enumerate(setup.participants)}
    return [index[u] for u in nodes]


def _seal_all(state: ClientState, holders: list[int], b: list[int],
              s: list[int]) -> tuple[tuple[EncryptedShare, ...], dict[int, bytes]]:
    """Encrypt each neighbour's shares; also derive the keys of the replies to come."""
    cipher_sk = X25519PrivateKey.from_private_bytes(state.cipher_key.private)
    node, session = state.node, state.session
    out, inbox = [], {}
    for v, bv, sv in zip(holders, b, s, strict=True):
        if v == node:
            continue
        send, inbox[v] = channel_keys(agree(cipher_sk, state.directory[v].cipher), session, node, v)
        plain = bv.to_bytes(SHARE_BYTES, "big") + sv.to_bytes(SHARE_BYTES, "big")
        sealed = seal_share(send, share_aad(session, node, v), plain)
        out.append(EncryptedShare(node, v, sealed))
    return tuple(out), inbox


def share_keys(state: ClientState, directory: KeyDirectory, entropy: Entropy,
               policy: ClientPolicy = _STRICT) -> tuple[ClientState, ShareKeysReply]:
    """Round 1: Shamir-share ``b_u`` and the mask private key to the live neighbours."""
    _expect(state, Stage.ADVERTISE_KEYS)
    live = _check_directory(state, directory)
    setup = state.setup
    session = session_digest(setup.round, setup_digest(setup), directory.entries)
    holders = _holders(state, live)
    _verify_advertisements(state, directory, holders, policy)
    seed = entropy(32)
    xs = _x_coordinates(setup, holders)
    b = split(seed, setup.threshold, xs, entropy)
    s = split(state.mask_key.private, setup.threshold, xs, entropy)
    own = holders.index(state.node)
    state = replace(state, stage=Stage.SHARE_KEYS, session=session, seed=seed,
                    directory={v: live[v] for v in holders}, held={state.node: (b[own], s[own])})
    shares, inbox = _seal_all(state, holders, b, s)
    state = replace(state, inbox_keys=inbox)
    return state, ShareKeysReply(self_mask_commitment(seed, session, state.node), shares)


def _open_all(state: ClientState, shares: tuple[EncryptedShare, ...]) -> dict[int, tuple[int, int]]:
    held = dict(state.held)
    for share in shares:
        sender = share.sender
        if share.receiver != state.node or sender == state.node or sender in held:
            raise SecAggProtocolError(f"client {state.node}: misrouted or replayed share from {sender}")
        if sender not in state.inbox_keys:
            raise SecAggProtocolError(f"client {state.node}: share from non-neighbour {sender}")
        aad = share_aad(state.session, sender, state.node)
        plain = open_share(state.inbox_keys[sender], aad, share.ciphertext)
        held[sender] = (int.from_bytes(plain[:SHARE_BYTES], "big"), int.from_bytes(plain[SHARE_BYTES:], "big"))
    return held


def _mask_seeds(state: ClientState, length: int) -> tuple[list[bytes], list[bytes]]:
    setup, node = state.setup, state.node
    plus = [self_mask_key(state.seed, state.session, node, length, setup.bits)]
    minus: list[bytes] = []
    mask_sk = X25519PrivateKey.from_private_bytes(state.mask_key.private)
    for v in state.peers:
        shared = agree(mask_sk, state.directory[v].mask)
        seed = pair_mask_key(shared, state.session, node, v, length, setup.bits)
        # u adds the pair mask when u < v and subtracts it otherwise: they cancel.
        (plus if node < v else minus).append(seed)
    return plus, minus


def normalised_weight(weight: float, max_weight: float) -> float:
    """``min(weight / max_weight, 1)``: the weight actually sent."""
    if not np.isfinite(weight) or weight < 0:
        raise ValueError(f"a client weight must be finite and >= 0, got {weight}")
    return min(float(weight) / max_weight, 1.0)


def masked_input(state: ClientState, request: MaskedInputRequest, update: np.ndarray,
                 weight: float, rng: np.random.Generator,
                 noise: GridNoise | None = None) -> tuple[ClientState, MaskedInput]:
    """Round 2: decrypt the shares received, then quantise (adding ``noise`` on the grid) and mask ``[w x, w]``."""
    _expect(state, Stage.SHARE_KEYS)
    held = _open_all(state, request.shares)
    setup = state.setup
    if len(held) < setup.threshold:
        raise SecAggProtocolError(
            f"client {state.node}: {len(held)} live share holders, threshold {setup.threshold}"
        )
    state = replace(state, stage=Stage.MASKED_INPUT, held=held,
                    peers=tuple(sorted(held.keys() - {state.node})))
    quantizer = Quantizer(setup.bits, setup.clip_range, len(setup.participants))
    vector, fill = quantizer.encoder(update, normalised_weight(weight, setup.max_weight), rng, noise)
    plus, minus = _mask_seeds(state, vector.shape[0])
    # Encode and mask chunk by chunk: the vector goes through memory once.
    MaskExpander(vector.shape[0], setup.bits).add_all(vector, plus, minus, fill=fill)
    return state, MaskedInput(vector)


def _check_unmask(state: ClientState, survivors: set[int], dropped: set[int]) -> None:
    node, t = state.node, state.setup.threshold
    if survivors & dropped:
        raise SecAggProtocolError(
            f"client {node}: refusing to reveal both secrets of {sorted(survivors & dropped)}"
        )
    if node in dropped or node not in survivors:
        raise SecAggProtocolError(f"client {node}: the server claims this client dropped")
    if not (survivors | dropped) <= state.held.keys():
        raise SecAggProtocolError(f"client {node}: asked for shares it does not hold")
    flips = {v for v in survivors if state.revealed.get(v) == "key"}
    flips |= {v for v in dropped if state.revealed.get(v) == "self"}
    if flips:
        raise SecAggProtocolError(f"client {node}: refusing to reveal both secrets of {sorted(flips)}")
    if len(survivors) < t:
        raise SecAggProtocolError(f"client {node}: only {len(survivors)} survivors, threshold {t}")


def consistency_check(state: ClientState, request: ConsistencyRequest,
                      policy: ClientPolicy = _STRICT) -> tuple[ClientState, ConsistencyReply]:
    """Round 3 of the actively secure variant: sign the survivor set ``U3`` the server announced."""
    _expect(state, Stage.MASKED_INPUT)
    node, setup, survivors = state.node, state.setup, request.survivors
    if setup.threat_model != MALICIOUS:
        raise SecAggProtocolError(f"client {node}: no consistency check in a semi-honest round")
    if list(survivors) != sorted(set(survivors)) or not set(survivors) <= set(setup.participants):
        raise SecAggProtocolError(f"client {node}: malformed survivor set")
    if node not in survivors:
        raise SecAggProtocolError(f"client {node}: the server claims this client dropped")
    if len(set(survivors) & state.held.keys()) < setup.threshold:
        raise SecAggProtocolError(f"client {node}: too few survivors, threshold {setup.threshold}")
    identity, _ = _enrolment(node, policy)
    signature = sign(identity, survivors_message(state.session, survivors))
    return replace(state, stage=Stage.CONSISTENCY_CHECK, consistency=survivors), ConsistencyReply(signature)


def _check_consistency(state: ClientState, request: UnmaskRequest, policy: ClientPolicy) -> None:
    """Reveal nothing unless ``t`` live neighbours signed the survivor set this client signed."""
    node, agreed = state.node, set(state.consistency)
    if not set(request.survivors) <= agreed or set(request.dropped) & agreed:
        raise SecAggProtocolError(f"client {node}: unmask request contradicts the survivor set it signed")
    _, enrolled = _enrolment(node, policy)
    message = survivors_message(state.session, state.consistency)
    signers: set[int] = set()
    for signed in request.signatures:
        v = signed.signer
        if v in signers or v not in agreed or v not in state.directory:
            raise SecAggProtocolError(f"client {node}: survivor signature from an unexpected client {v}")
        if not enrolled.verify(v, signed.signature, message):
            raise SecAggCryptoError()
        signers.add(v)
    if len(signers) < state.setup.threshold:
        raise SecAggProtocolError(
            f"client {node}: {len(signers)} neighbours confirmed the survivors, threshold {state.setup.threshold}"
        )


def unmask(state: ClientState, request: UnmaskRequest,
           policy: ClientPolicy = _STRICT) -> tuple[ClientState, UnmaskReply]:
    """Round 4: reveal ``b_v`` shares of survivors and ``s_v`` shares of dropped clients.

    Never both for one peer (Bonawitz et al., Sec. 4): with both, the server
    could strip every mask off that peer's input. In a malicious round, only
    after the consistency check (Sec. 6) and only as the signed set says.
    """
    if state.setup.threat_model == MALICIOUS:
        _expect(state, Stage.CONSISTENCY_CHECK, Stage.UNMASK)
        _check_consistency(state, request, policy)
    else:
        _expect(state, Stage.MASKED_INPUT, Stage.UNMASK)
    survivors, dropped = set(request.survivors), set(request.dropped)
    _check_unmask(state, survivors, dropped)
    revealed = dict(state.revealed)
    revealed.update({v: "self" for v in survivors})
    revealed.update({v: "key" for v in dropped})
    reply = UnmaskReply(
        tuple(RevealedShare(v, state.held[v][0]) for v in sorted(survivors)),
        tuple(RevealedShare(v, state.held[v][1]) for v in sorted(dropped)),
    )
    return replace(state, stage=Stage.UNMASK, revealed=revealed), reply


def client_step(state: ClientState | None, node: int, request: Request, *, entropy: Entropy,
                rng: np.random.Generator, train: Trainer | None = None,
                policy: ClientPolicy = _STRICT) -> tuple[ClientState, Reply]:
    """Dispatch one request to its step; ``train`` supplies ``(update, weight)``."""
    if isinstance(request, RoundSetup):
        return advertise_keys(node, request, entropy, policy)
    if state is None:
        raise SecAggProtocolError(f"client {node}: no round in progress")
    if isinstance(request, KeyDirectory):
        return share_keys(state, request, entropy, policy)
    if isinstance(request, ConsistencyRequest):
        return consistency_check(state, request, policy)
    if isinstance(request, MaskedInputRequest):
        if train is None:
            raise ValueError("the masked-input stage needs a trainer")
        _expect(state, Stage.SHARE_KEYS)  # before spending a training run
        update, weight, *noise = train()
        return masked_input(state, request, update, weight, rng, noise[0] if noise else None)
    if isinstance(request, UnmaskRequest):
        return unmask(state, request, policy)
    raise SecAggProtocolError(f"client {node}: unknown request {type(request).__name__}")

