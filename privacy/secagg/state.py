"""A client's per-round protocol state: immutable, and serialisable to bytes.

Flower keeps a ClientApp's ``context.state`` between messages of a run, even
when each message runs in a fresh process (deployment runtime), so the state
must round-trip through bytes. It holds the round's private keys and the
shares received from neighbours; it never leaves the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from privacy.secagg.codec import Reader, Writer, decode, encode, read_entries, write_entries
from privacy.secagg.errors import SecAggProtocolError
from privacy.secagg.keys import KEY_BYTES, KeyPair, PublicKeys
from privacy.secagg.messages import RoundSetup
from privacy.secagg.shamir import SHARE_BYTES
from privacy.secagg.stage import STAGE_ORDER, Stage

__all__ = ["ClientState", "state_from_bytes", "state_to_bytes"]

_REVEAL_CODES = ("self", "key")


@dataclass(frozen=True)
class ClientState:
    """What a client remembers between the stages of one round.

    Attributes
    ----------
    node : int
        This client's id.
    setup : RoundSetup
        The round's public parameters.
    stage : Stage
        The last stage this client completed.
    cipher_key, mask_key : KeyPair
        The round's two X25519 key pairs.
    session : bytes
        Session digest (set at SHARE_KEYS).
    directory : Mapping[int, PublicKeys]
        Public keys of this client's live closed neighbourhood.
    seed : bytes
        The self-mask seed ``b_u``.
    inbox_keys : Mapping[int, bytes]
        AES-GCM keys of the share messages each neighbour will send here.
    held : Mapping[int, tuple[int, int]]
        ``owner -> (share of b_owner, share of s_owner)``.
    peers : tuple[int, ...]
        The neighbours this client masked its input with.
    revealed : Mapping[int, str]
        ``owner -> "self" | "key"``: which of ``owner``'s secrets were revealed.
    consistency : tuple[int, ...]
        The survivor set this client signed at CONSISTENCY_CHECK (malicious model).
    """

    node: int
    setup: RoundSetup
    stage: Stage
    cipher_key: KeyPair
    mask_key: KeyPair
    session: bytes = b""
    directory: Mapping[int, PublicKeys] = field(default_factory=dict)
    seed: bytes = b""
    inbox_keys: Mapping[int, bytes] = field(default_factory=dict)
    held: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    peers: tuple[int, ...] = ()
    revealed: Mapping[int, str] = field(default_factory=dict)
    consistency: tuple[int, ...] = ()


def _w_head(w: Writer, s: ClientState) -> None:
    w.pack("QB", s.node, STAGE_ORDER.index(s.stage)).blob(encode(s.setup))
    for pair in (s.cipher_key, s.mask_key):
        w.raw(pair.private, KEY_BYTES).raw(pair.public, KEY_BYTES)
    w.blob(s.session).blob(s.seed)


def _w_body(w: Writer, s: ClientState) -> None:
    write_entries(w, s.directory.values())
    w.records("Q16s", list(s.inbox_keys.items()))
    w.records(f"Q{SHARE_BYTES}s{SHARE_BYTES}s",
              [(o, b.to_bytes(SHARE_BYTES, "big"), k.to_bytes(SHARE_BYTES, "big")) for o, (b, k) in s.held.items()])
    w.ids(s.peers).records("QB", [(o, _REVEAL_CODES.index(kind)) for o, kind in s.revealed.items()])
    w.ids(s.consistency)


def state_to_bytes(state: ClientState) -> bytes:
    """Serialise ``state`` (private keys included: keep it on the client)."""
    w = Writer()
    _w_head(w, state)
    _w_body(w, state)
    return w.getvalue()


def _r_pair(r: Reader) -> KeyPair:
    return KeyPair(r.raw(KEY_BYTES), r.raw(KEY_BYTES))


def _r_held(r: Reader) -> dict[int, tuple[int, int]]:
    rows = r.records(f"Q{SHARE_BYTES}s{SHARE_BYTES}s")
    return {o: (int.from_bytes(b, "big"), int.from_bytes(k, "big")) for o, b, k in rows}


def state_from_bytes(data: bytes) -> ClientState:
    """Inverse of :func:`state_to_bytes`."""
    r = Reader(data)
    try:
        node, stage = r.unpack("QB")
        setup = decode(r.blob(), RoundSetup)
        cipher, mask = _r_pair(r), _r_pair(r)
        session, seed = r.blob(), r.blob()
        directory = {e.owner: e for e in read_entries(r)}
        inbox = dict(r.records("Q16s"))
        held = _r_held(r)
        peers = r.ids()
        revealed = {o: _REVEAL_CODES[code] for o, code in r.records("QB")}
        consistency = r.ids()
        state = ClientState(node, setup, STAGE_ORDER[stage], cipher, mask, session,
                            directory, seed, inbox, held, peers, revealed, consistency)
    except (IndexError, ValueError) as exc:
        raise SecAggProtocolError("corrupt secure-aggregation client state") from exc
    r.finish()
    return state
