"""Typed protocol messages, one frozen dataclass per request and reply.

The names follow the rounds of Bonawitz et al., CCS 2017, Fig. 4:

=================  ===========================  =========================
stage              server -> client             client -> server
=================  ===========================  =========================
ADVERTISE_KEYS     :class:`RoundSetup`          :class:`KeyAdvertisement`
SHARE_KEYS         :class:`KeyDirectory`        :class:`ShareKeysReply`
MASKED_INPUT       :class:`MaskedInputRequest`  :class:`MaskedInput`
UNMASK             :class:`UnmaskRequest`       :class:`UnmaskReply`
=================  ===========================  =========================
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from privacy.secagg.keys import PublicKeys
from privacy.secagg.stage import Stage

__all__ = [
    "REPLY_TYPES",
    "REQUEST_TYPES",
    "EncryptedShare",
    "KeyAdvertisement",
    "KeyDirectory",
    "MaskedInput",
    "MaskedInputRequest",
    "PublicKeys",
    "Reply",
    "Request",
    "RevealedShare",
    "RoundSetup",
    "ShareKeysReply",
    "UnmaskReply",
    "UnmaskRequest",
]


@dataclass(frozen=True)
class RoundSetup:
    """Everything a client needs to take part in one round (broadcast).

    ``participants`` is sorted; a client's Shamir x-coordinate is its index
    in it plus one.
    """

    round: int
    participants: tuple[int, ...]
    threshold: int
    graph: str
    degree: int
    graph_seed: bytes
    clip_range: float
    bits: int
    max_weight: float

    def x_of(self, node: int) -> int:
        """Shamir x-coordinate of ``node``."""
        return self.participants.index(node) + 1


@dataclass(frozen=True)
class KeyAdvertisement:
    """A client's two fresh X25519 public keys."""

    cipher: bytes
    mask: bytes


@dataclass(frozen=True)
class KeyDirectory:
    """The public keys of every client that advertised (broadcast)."""

    entries: tuple[PublicKeys, ...]


@dataclass(frozen=True)
class EncryptedShare:
    """``sender``'s shares for ``receiver``, AES-GCM encrypted, relayed by the server."""

    sender: int
    receiver: int
    ciphertext: bytes


@dataclass(frozen=True)
class ShareKeysReply:
    """One encrypted share message per neighbour, plus a commitment to ``b_u``."""

    commitment: bytes
    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True)
class MaskedInputRequest:
    """The shares addressed to this client by clients that completed SHARE_KEYS."""

    shares: tuple[EncryptedShare, ...]


@dataclass(frozen=True, eq=False)
class MaskedInput:
    """The masked, quantised vector ``[w x, w]`` in ``Z_{2^bits}``."""

    vector: np.ndarray


@dataclass(frozen=True)
class UnmaskRequest:
    """Which neighbours survived (reveal ``b``) and which dropped (reveal ``s_sk``)."""

    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class RevealedShare:
    """The share a client holds of ``owner``'s secret (a field element)."""

    owner: int
    value: int


@dataclass(frozen=True)
class UnmaskReply:
    """Self-mask shares of survivors and mask-key shares of dropped clients."""

    self_mask_shares: tuple[RevealedShare, ...]
    mask_key_shares: tuple[RevealedShare, ...]


Request = RoundSetup | KeyDirectory | MaskedInputRequest | UnmaskRequest
Reply = KeyAdvertisement | ShareKeysReply | MaskedInput | UnmaskReply

REQUEST_TYPES: dict[Stage, type] = {
    Stage.ADVERTISE_KEYS: RoundSetup,
    Stage.SHARE_KEYS: KeyDirectory,
    Stage.MASKED_INPUT: MaskedInputRequest,
    Stage.UNMASK: UnmaskRequest,
}
REPLY_TYPES: dict[Stage, type] = {
    Stage.ADVERTISE_KEYS: KeyAdvertisement,
    Stage.SHARE_KEYS: ShareKeysReply,
    Stage.MASKED_INPUT: MaskedInput,
    Stage.UNMASK: UnmaskReply,
}
