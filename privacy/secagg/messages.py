"""Typed protocol messages, one frozen dataclass per request and reply.

The names follow the rounds of Bonawitz et al., CCS 2017, Fig. 4:

=================  ===========================  =========================
stage              server -> client             client -> server
=================  ===========================  =========================
ADVERTISE_KEYS     :class:`RoundSetup`          :class:`KeyAdvertisement`
SHARE_KEYS         :class:`KeyDirectory`        :class:`ShareKeysReply`
MASKED_INPUT       :class:`MaskedInputRequest`  :class:`MaskedInput`
CONSISTENCY_CHECK  :class:`ConsistencyRequest`  :class:`ConsistencyReply`
UNMASK             :class:`UnmaskRequest`       :class:`UnmaskReply`
=================  ===========================  =========================

CONSISTENCY_CHECK and the signatures run only when the round's
``threat_model`` is ``"malicious"`` (Bonawitz et al., Sec. 6); otherwise the
signature fields are empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from privacy.secagg.keys import PublicKeys
from privacy.secagg.stage import Stage

__all__ = [
    "REPLY_TYPES",
    "REQUEST_TYPES",
    "ConsistencyReply",
    "ConsistencyRequest",
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
    "SignedSurvivors",
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
    threat_model: str = "malicious"

    def x_of(self, node: int) -> int:
        """Shamir x-coordinate of ``node``."""
        return self.participants.index(node) + 1


@dataclass(frozen=True)
class KeyAdvertisement:
    """A client's two fresh X25519 public keys, signed with its enrolled identity key.

    ``signature`` covers the round setup's digest, the client id and both
    keys (empty in a semi-honest round).
    """

    cipher: bytes
    mask: bytes
    signature: bytes = b""


@dataclass(frozen=True)
class KeyDirectory:
    """The public keys of every client that advertised (broadcast).

    ``signatures[i]`` is ``entries[i].owner``'s advertisement signature
    (none in a semi-honest round).
    """

    entries: tuple[PublicKeys, ...]
    signatures: tuple[bytes, ...] = ()


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
class ConsistencyRequest:
    """The survivor set ``U3``: every client whose masked input is in the sum."""

    survivors: tuple[int, ...]


@dataclass(frozen=True)
class ConsistencyReply:
    """The client's signature of the survivor set it was told."""

    signature: bytes


@dataclass(frozen=True)
class SignedSurvivors:
    """``signer``'s signature of the survivor set, relayed by the server."""

    signer: int
    signature: bytes


@dataclass(frozen=True)
class UnmaskRequest:
    """Which neighbours survived (reveal ``b``) and which dropped (reveal ``s_sk``).

    In a malicious-model round it also carries the neighbours' signatures of
    the survivor set: the client reveals nothing unless ``t`` of them signed
    the set it signed.
    """

    survivors: tuple[int, ...]
    dropped: tuple[int, ...]
    signatures: tuple[SignedSurvivors, ...] = ()


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


Request = RoundSetup | KeyDirectory | MaskedInputRequest | ConsistencyRequest | UnmaskRequest
Reply = KeyAdvertisement | ShareKeysReply | MaskedInput | ConsistencyReply | UnmaskReply

REQUEST_TYPES: dict[Stage, type] = {
    Stage.ADVERTISE_KEYS: RoundSetup,
    Stage.SHARE_KEYS: KeyDirectory,
    Stage.MASKED_INPUT: MaskedInputRequest,
    Stage.CONSISTENCY_CHECK: ConsistencyRequest,
    Stage.UNMASK: UnmaskRequest,
}
REPLY_TYPES: dict[Stage, type] = {
    Stage.ADVERTISE_KEYS: KeyAdvertisement,
    Stage.SHARE_KEYS: ShareKeysReply,
    Stage.MASKED_INPUT: MaskedInput,
    Stage.CONSISTENCY_CHECK: ConsistencyReply,
    Stage.UNMASK: UnmaskReply,
}
