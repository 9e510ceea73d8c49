"""Enrolled identities for the actively secure protocol: Ed25519 keys and their directory.

Against a server that lies (Bonawitz et al., CCS 2017, Sec. 6, "active
adversary"), every client signs its key advertisement and its view of the
survivors with a long-term identity key enrolled *out of band*, and checks
its neighbours' signatures against an enrolment directory ``client id ->
Ed25519 public key``. The directory's integrity is the operator's
responsibility (a CA or the operator's signature, never the aggregator's
word alone): whoever can add an entry to it can add Sybil clients.

In simulation each virtual client gets a fresh key pair per run
(:func:`enrol`), handed to it through its node config (:func:`node_config`).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from privacy.secagg.errors import SecAggConfigError

__all__ = [
    "MALICIOUS",
    "SEMI_HONEST",
    "SIGNATURE_BYTES",
    "THREAT_MODELS",
    "ClientPolicy",
    "IdentityDirectory",
    "advertisement_message",
    "enrol",
    "node_config",
    "policy_from_node_config",
    "public_identity",
    "write_identity",
    "sign",
    "survivors_message",
]

SEMI_HONEST = "semi-honest"
MALICIOUS = "malicious"
THREAT_MODELS = (SEMI_HONEST, MALICIOUS)
SIGNATURE_BYTES = 64
_ADVERTISE = b"quorum/secagg/v1/advertise"
_SURVIVORS = b"quorum/secagg/v1/survivors"

# Node-config keys (simulation: set by the runtime; deployment: by the node's operator).
THREAT_MODEL_KEY = "secagg-threat-model"
IDENTITY_KEY = "secagg-identity-key"            # hex of the raw 32-byte Ed25519 private key
IDENTITY_FILE_KEY = "secagg-identity-key-file"  # a file holding that hex
DIRECTORY_KEY = "secagg-directory"              # path of the enrolment directory (JSON)
DIRECTORY_JSON_KEY = "secagg-directory-json"    # the directory itself, inline (simulation)


class IdentityDirectory:
    """Enrolled public identity keys: ``client id -> 32-byte Ed25519 public key``.

    Parameters
    ----------
    keys : Mapping[int, bytes]
        The enrolment, as distributed out of band.
    """

    def __init__(self, keys: Mapping[int, bytes]) -> None:
        if any(len(k) != 32 for k in keys.values()):
            raise SecAggConfigError("directory", "<keys>", "identity public keys must be 32 bytes")
        self._raw = dict(keys)
        self._keys = {u: Ed25519PublicKey.from_public_bytes(k) for u, k in keys.items()}

    def __contains__(self, node: object) -> bool:
        """Whether ``node`` is enrolled."""
        return node in self._keys

    def __len__(self) -> int:
        """Return the number of enrolled clients."""
        return len(self._keys)

    def verify(self, node: int, signature: bytes, message: bytes) -> bool:
        """Whether ``signature`` is ``node``'s enrolled key's signature of ``message``."""
        key = self._keys.get(node)
        if key is None or len(signature) != SIGNATURE_BYTES:
            return False
        try:
            key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def to_json(self) -> str:
        """``{"<id>": "<hex public key>", ...}``."""
        return json.dumps({str(u): k.hex() for u, k in sorted(self._raw.items())})

    @classmethod
    def from_json(cls, text: str) -> IdentityDirectory:
        """Inverse of :meth:`to_json`; a malformed file is a config error."""
        try:
            raw = json.loads(text)
            return cls({int(u): bytes.fromhex(k) for u, k in raw.items()})
        except (ValueError, TypeError, AttributeError) as exc:
            raise SecAggConfigError("directory", "<json>", f"malformed enrolment directory: {exc}") from exc


@dataclass(frozen=True)
class ClientPolicy:
    """What a client accepts, decided by the client (never by the server).

    Attributes
    ----------
    threat_model : {"malicious", "semi-honest"}
        ``"malicious"`` refuses any round that is not actively secure or
        whose threshold is not a strict majority of each neighbourhood;
        ``"semi-honest"`` also accepts lower thresholds and unsigned rounds.
    identity : bytes | None
        This client's raw 32-byte Ed25519 private identity key.
    directory : IdentityDirectory | None
        The enrolment directory that neighbours' signatures are checked against.
    """

    threat_model: str = MALICIOUS
    identity: bytes | None = field(default=None, repr=False)
    directory: IdentityDirectory | None = None

    def __post_init__(self) -> None:
        """Refuse a threat model other than ``"malicious"`` or ``"semi-honest"``."""
        if self.threat_model not in THREAT_MODELS:
            raise SecAggConfigError("threat_model", self.threat_model, f"must be one of {THREAT_MODELS}")


def sign(identity: bytes, message: bytes) -> bytes:
    """Ed25519 signature of ``message`` under the raw private key ``identity``."""
    return _private(identity).sign(message)


@functools.lru_cache(maxsize=4096)
def _private(identity: bytes) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(identity)


def advertisement_message(setup_digest: bytes, node: int, cipher: bytes, mask: bytes) -> bytes:
    """Return what a client signs at ADVERTISE_KEYS: its two keys, bound to this round's setup."""
    return _ADVERTISE + setup_digest + struct.pack(">Q", node) + cipher + mask


def survivors_message(session: bytes, survivors: Iterable[int]) -> bytes:
    """Return what a client signs at CONSISTENCY_CHECK: the survivor set it was told, bound to the session."""
    ids = sorted(survivors)
    return _SURVIVORS + session + struct.pack(f">I{len(ids)}Q", len(ids), *ids)


def public_identity(identity: bytes) -> bytes:
    """Return the raw 32-byte Ed25519 public key of the raw private key ``identity``."""
    return _private(identity).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def write_identity(path: Path) -> Path:
    """Make an identity key pair on disk: ``path`` (private, hex, 0600) and ``path.pub`` (public, hex).

    Run on the device (``quorum client keygen --secagg``), the private half
    never leaves it; the ``.pub`` file is what the operator enrols.
    """
    private = os.urandom(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(private.hex() + "\n")
    public = path.with_name(path.name + ".pub")
    public.write_text(public_identity(private).hex() + "\n")
    return public


def enrol(nodes: Iterable[int],
          entropy: Callable[[int], bytes] = os.urandom) -> tuple[dict[int, bytes], IdentityDirectory]:
    """Enrol nodes for a simulation: a fresh identity key per node, and the directory of their public keys."""
    private = {u: entropy(32) for u in nodes}
    return private, IdentityDirectory({u: public_identity(k) for u, k in private.items()})


def node_config(nodes: Iterable[int], threat_model: str = MALICIOUS,
                entropy: Callable[[int], bytes] = os.urandom) -> dict[int, dict[str, str]]:
    """Node-config entries that give each simulated node its identity and the directory."""
    private, directory = enrol(nodes, entropy)
    text = directory.to_json()
    return {u: {THREAT_MODEL_KEY: threat_model, IDENTITY_KEY: k.hex(), DIRECTORY_JSON_KEY: text}
            for u, k in private.items()}


@functools.lru_cache(maxsize=8)
def _directory_from_json(text: str) -> IdentityDirectory:
    return IdentityDirectory.from_json(text)


def _directory_of(config: Mapping[str, object]) -> IdentityDirectory | None:
    if isinstance(config.get(DIRECTORY_JSON_KEY), str):
        return _directory_from_json(str(config[DIRECTORY_JSON_KEY]))
    if isinstance(config.get(DIRECTORY_KEY), str):
        return _directory_from_json(Path(str(config[DIRECTORY_KEY])).read_text())
    return None


def _identity_of(config: Mapping[str, object]) -> bytes | None:
    text = config.get(IDENTITY_KEY)
    if not isinstance(text, str) and isinstance(config.get(IDENTITY_FILE_KEY), str):
        text = Path(str(config[IDENTITY_FILE_KEY])).read_text().strip()
    try:
        return bytes.fromhex(text) if isinstance(text, str) else None
    except ValueError as exc:
        raise SecAggConfigError(IDENTITY_KEY, "<secret>", "must be hex") from exc


def policy_from_node_config(config: Mapping[str, object]) -> ClientPolicy:
    """Read a node's policy from its node config; unset means ``"malicious"`` (refuse what it cannot verify)."""
    threat = str(config.get(THREAT_MODEL_KEY, MALICIOUS))
    return ClientPolicy(threat, _identity_of(config), _directory_of(config))
