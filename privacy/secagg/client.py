"""The client side of the protocol as four pure steps: state in, new state and reply out.

Follows Bonawitz et al., CCS 2017, Fig. 4 (client rounds 0-4, without the
optional consistency-check round of the actively secure variant), on the
neighbour graph of Bell et al., CCS 2020. A client that sees the server (or
a peer) deviate raises :class:`SecAggProtocolError` or
:class:`SecAggCryptoError` and sends nothing; to the server that is a dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from privacy.secagg.aead import open_share, seal_share, share_aad
from privacy.secagg.codec import setup_digest
from privacy.secagg.errors import SecAggProtocolError
from privacy.secagg.graph import neighbours
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
from privacy.secagg.prg import MaskExpander
from privacy.secagg.quantize import Quantizer
from privacy.secagg.shamir import SHARE_BYTES, split
from privacy.secagg.stage import Stage
from privacy.secagg.state import ClientState

__all__ = [
    "Trainer",
    "advertise_keys",
    "client_step",
    "masked_input",
    "normalised_weight",
    "share_keys",
    "unmask",
]

Entropy = Callable[[int], bytes]
Trainer = Callable[[], tuple[np.ndarray, float]]


def _expect(state: ClientState, *allowed: Stage) -> None:
    if state.stage not in allowed:
        raise SecAggProtocolError(
            f"client {state.node}: out-of-order request after stage '{state.stage.value}'"
        )


def _check_setup(node: int, setup: RoundSetup) -> None:
    ids = setup.participants
    if node not in ids or len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        raise SecAggProtocolError(f"client {node}: malformed participant list")
    if not 2 <= setup.threshold <= setup.degree + 1 or setup.degree >= len(ids):
        raise SecAggProtocolError(
            f"client {node}: threshold {setup.threshold} unsafe for degree {setup.degree}"
        )
    if setup.bits not in (32, 64) or not setup.clip_range > 0 or not setup.max_weight > 0:
        raise SecAggProtocolError(f"client {node}: malformed quantisation parameters")


def advertise_keys(node: int, setup: RoundSetup, entropy: Entropy) -> tuple[ClientState, KeyAdvertisement]:
    """Round 0: make two fresh X25519 key pairs and advertise the public halves."""
    _check_setup(node, setup)
    cipher, mask = generate_keypair(entropy), generate_keypair(entropy)
    state = ClientState(node, setup, Stage.ADVERTISE_KEYS, cipher, mask)
    return state, KeyAdvertisement(cipher.public, mask.public)


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


def share_keys(state: ClientState, directory: KeyDirectory,
               entropy: Entropy) -> tuple[ClientState, ShareKeysReply]:
    """Round 1: Shamir-share ``b_u`` and the mask private key to the live neighbours."""
    _expect(state, Stage.ADVERTISE_KEYS)
    live = _check_directory(state, directory)
    setup = state.setup
    session = session_digest(setup.round, setup_digest(setup), directory.entries)
    holders = _holders(state, live)
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
                 weight: float, rng: np.random.Generator) -> tuple[ClientState, MaskedInput]:
    """Round 2: decrypt the shares received, then quantise and mask ``[w x, w]``."""
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
    vector, fill = quantizer.encoder(update, normalised_weight(weight, setup.max_weight), rng)
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


def unmask(state: ClientState, request: UnmaskRequest) -> tuple[ClientState, UnmaskReply]:
    """Round 3: reveal ``b_v`` shares of survivors and ``s_v`` shares of dropped clients.

    Never both for one peer (Bonawitz et al., Sec. 4): with both, the server
    could strip every mask off that peer's input.
    """
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
                rng: np.random.Generator, train: Trainer | None = None) -> tuple[ClientState, Reply]:
    """Dispatch one request to its step; ``train`` supplies ``(update, weight)``."""
    if isinstance(request, RoundSetup):
        return advertise_keys(node, request, entropy)
    if state is None:
        raise SecAggProtocolError(f"client {node}: no round in progress")
    if isinstance(request, KeyDirectory):
        return share_keys(state, request, entropy)
    if isinstance(request, MaskedInputRequest):
        if train is None:
            raise ValueError("the masked-input stage needs a trainer")
        _expect(state, Stage.SHARE_KEYS)  # before spending a training run
        return masked_input(state, request, *train(), rng)
    if isinstance(request, UnmaskRequest):
        return unmask(state, request)
    raise SecAggProtocolError(f"client {node}: unknown request {type(request).__name__}")

