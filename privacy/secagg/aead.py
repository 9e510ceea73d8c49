"""Authenticated encryption of Shamir shares: AES-128-GCM with bound associated data.

The associated data binds each ciphertext to its session, stage, sender and
receiver (Bonawitz et al., CCS 2017, Sec. 4, "u || v || shares" encrypted
under the pairwise channel key). A tampered, misrouted or replayed ciphertext
fails the tag check and surfaces as the opaque :class:`SecAggCryptoError`.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from privacy.secagg.errors import SecAggCryptoError

__all__ = ["TAG_BYTES", "open_share", "seal_share", "share_aad"]

TAG_BYTES = 16
# Each key is derived per (session, sender, receiver) and encrypts one
# message, so a constant nonce never repeats under one key.
_NONCE = bytes(12)
_AAD_LABEL = b"quorum/secagg/v1/share-aad"


def share_aad(session: bytes, sender: int, receiver: int) -> bytes:
    """Associated data of the share message ``sender -> receiver``."""
    return _AAD_LABEL + session + struct.pack(">QQ", sender, receiver)


def seal_share(key: bytes, aad: bytes, plaintext: bytes) -> bytes:
    """Encrypt and authenticate ``plaintext``."""
    return AESGCM(key).encrypt(_NONCE, plaintext, aad)


def open_share(key: bytes, aad: bytes, ciphertext: bytes) -> bytes:
    """Decrypt ``ciphertext``; any failure is a :class:`SecAggCryptoError`."""
    try:
        return AESGCM(key).decrypt(_NONCE, ciphertext, aad)
    except (InvalidTag, ValueError) as exc:
        raise SecAggCryptoError() from exc
