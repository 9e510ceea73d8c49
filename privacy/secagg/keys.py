"""Key agreement and key derivation: X25519 and HKDF-SHA256 bound to the session.

Each client makes two X25519 key pairs per round (Bonawitz et al., CCS 2017,
Sec. 4): ``cipher`` keys to encrypt the shares it sends to its neighbours,
and ``mask`` keys whose pairwise agreement seeds the cancelling masks. Every
derived key goes through HKDF-SHA256 (RFC 5869) with the session digest as
salt and a distinct label per use, so a key is never reused across rounds,
participant sets, directions or purposes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from privacy.secagg.errors import SecAggCryptoError

__all__ = [
    "KEY_BYTES",
    "KeyPair",
    "PublicKeys",
    "agree",
    "channel_keys",
    "derive_key",
    "generate_keypair",
    "pair_mask_key",
    "public_of",
    "self_mask_commitment",
    "self_mask_key",
    "session_digest",
]

KEY_BYTES = 32
_PREFIX = b"quorum/secagg/v1/"
_ENC = _PREFIX + b"share-enc"
_PAIR = _PREFIX + b"pair-mask"
_SELF = _PREFIX + b"self-mask"
_COMMIT = _PREFIX + b"self-commit"
_SESSION = _PREFIX + b"session"

Entropy = Callable[[int], bytes]


@dataclass(frozen=True)
class KeyPair:
    """A raw X25519 key pair (32-byte private and public keys)."""

    private: bytes
    public: bytes


@dataclass(frozen=True)
class PublicKeys:
    """One client's advertised public keys, as listed in the key directory."""

    owner: int
    cipher: bytes
    mask: bytes


def generate_keypair(entropy: Entropy) -> KeyPair:
    """Generate a fresh X25519 key pair from ``entropy(32)``."""
    private = entropy(KEY_BYTES)
    key = X25519PrivateKey.from_private_bytes(private)
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return KeyPair(private=private, public=public)


def public_of(private: bytes) -> bytes:
    """Return the public key belonging to a raw private key."""
    try:
        key = X25519PrivateKey.from_private_bytes(private)
    except ValueError as exc:
        raise SecAggCryptoError() from exc
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def agree(private: X25519PrivateKey, public: bytes) -> bytes:
    """X25519 shared secret; a malformed or low-order peer key is a crypto error."""
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as exc:
        raise SecAggCryptoError() from exc


def derive_key(ikm: bytes, session: bytes, info: bytes, length: int = 16) -> bytes:
    """HKDF-SHA256 with the session digest as salt."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=session, info=info).derive(ikm)


def _ids(*ids: int) -> bytes:
    return struct.pack(f">{len(ids)}Q", *ids)


def channel_keys(shared: bytes, session: bytes, me: int, peer: int) -> tuple[bytes, bytes]:
    """AES-128-GCM keys ``(me -> peer, peer -> me)`` of one pair's share messages.

    One HKDF call yields both directions (the first half for the lower id's
    direction); each key encrypts exactly one message, so a fixed nonce is
    safe.
    """
    low, high = min(me, peer), max(me, peer)
    okm = derive_key(shared, session, _ENC + _ids(low, high), 32)
    up, down = okm[:16], okm[16:]
    return (up, down) if me == low else (down, up)


def _layout(length: int, bits: int) -> bytes:
    return struct.pack(">QB", length, bits)


def pair_mask_key(shared: bytes, session: bytes, a: int, b: int, length: int, bits: int) -> bytes:
    """AES-128-CTR key of the pairwise mask between clients ``a`` and ``b``."""
    low, high = min(a, b), max(a, b)
    return derive_key(shared, session, _PAIR + _ids(low, high) + _layout(length, bits))


def self_mask_key(seed: bytes, session: bytes, owner: int, length: int, bits: int) -> bytes:
    """AES-128-CTR key of ``owner``'s self mask, from its secret seed ``b_u``."""
    return derive_key(seed, session, _SELF + _ids(owner) + _layout(length, bits))


def self_mask_commitment(seed: bytes, session: bytes, owner: int) -> bytes:
    """Return a binding commitment to ``b_u``, checked after the server rebuilds it."""
    return hashlib.sha256(_COMMIT + session + _ids(owner) + seed).digest()


def session_digest(round_id: int, setup_digest: bytes, directory: Iterable[PublicKeys]) -> bytes:
    """SHA-256 over the round, the round setup and every advertised key.

    Both ends of every pair compute it from the same broadcast directory, so
    all derived keys are bound to this round and this participant set.
    """
    h = hashlib.sha256(_SESSION + _ids(round_id) + setup_digest)
    for entry in sorted(directory, key=lambda e: e.owner):
        h.update(_ids(entry.owner) + entry.cipher + entry.mask)
    return h.digest()
