"""Canonical binary encoding of the protocol messages.

The encoding is what travels inside the ``"secagg"`` ConfigRecord, what the
per-stage byte counts measure, and what the round setup digest (bound into
every derived key) is computed over. Big-endian, length-prefixed, versioned;
anything malformed raises :class:`SecAggProtocolError`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any, TypeVar

import numpy as np

from privacy.secagg.errors import SecAggProtocolError
from privacy.secagg.keys import KEY_BYTES, PublicKeys
from privacy.secagg.messages import (
    ConsistencyReply,
    ConsistencyRequest,
    EncryptedShare,
    KeyAdvertisement,
    KeyDirectory,
    MaskedInput,
    MaskedInputRequest,
    RevealedShare,
    RoundSetup,
    ShareKeysReply,
    SignedSurvivors,
    UnmaskReply,
    UnmaskRequest,
)
from privacy.secagg.prg import RING_BITS, dtype_for
from privacy.secagg.shamir import SHARE_BYTES

__all__ = [
    "Reader",
    "Writer",
    "decode",
    "encode",
    "read_entries",
    "setup_digest",
    "wire_size",
    "write_entries",
]

_VERSION = 1
_GRAPHS = ("complete", "kregular")
_THREATS = ("semi-honest", "malicious")
_SIG = 64
T = TypeVar("T")


class Writer:
    """Appends fixed-layout fields to a byte string."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def pack(self, fmt: str, *values: Any) -> Writer:
        """Append ``values`` packed big-endian with the ``struct`` format ``fmt``."""
        self._parts.append(struct.pack(">" + fmt, *values))
        return self

    def raw(self, data: bytes, size: int) -> Writer:
        """Append ``data`` as is; it must be exactly ``size`` bytes."""
        if len(data) != size:
            raise SecAggProtocolError(f"field must be {size} bytes, got {len(data)}")
        self._parts.append(data)
        return self

    def blob(self, data: bytes) -> Writer:
        """Append ``data`` after its length (a 32-bit prefix)."""
        return self.pack("I", len(data)).raw(data, len(data))

    def ids(self, ids: tuple[int, ...]) -> Writer:
        """Append a count, then each id as a 64-bit integer."""
        return self.pack(f"I{len(ids)}Q", len(ids), *ids)

    def records(self, fmt: str, rows: list[tuple[Any, ...]]) -> Writer:
        """Append a count, then every row packed with ``fmt`` (one ``struct`` call)."""
        try:
            return self.pack("I" + fmt * len(rows), len(rows), *chain.from_iterable(rows))
        except struct.error as exc:
            raise SecAggProtocolError(f"cannot encode records: {exc}") from exc

    def getvalue(self) -> bytes:
        """Return the bytes written so far."""
        return b"".join(self._parts)


class Reader:
    """Reads the fields a :class:`Writer` wrote; any mismatch is a protocol error."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        """Read the values of the big-endian ``struct`` format ``fmt``."""
        size = struct.calcsize(">" + fmt)
        return struct.unpack(">" + fmt, self.raw(size))

    def one(self, fmt: str) -> Any:
        """Read the single value of the ``struct`` format ``fmt``."""
        return self.unpack(fmt)[0]

    def raw(self, size: int) -> bytes:
        """Read the next ``size`` bytes; fewer left is a truncated message."""
        if size < 0 or self._pos + size > len(self._data):
            raise SecAggProtocolError("truncated secure-aggregation message")
        out = bytes(self._data[self._pos:self._pos + size])
        self._pos += size
        return out

    def blob(self) -> bytes:
        """Read bytes :meth:`Writer.blob` wrote."""
        return self.raw(self.one("I"))

    def ids(self) -> tuple[int, ...]:
        """Read ids :meth:`Writer.ids` wrote."""
        count = self.one("I")
        return self.unpack(f"{count}Q") if count else ()

    def records(self, fmt: str) -> list[tuple[Any, ...]]:
        """Inverse of :meth:`Writer.records`."""
        size = struct.calcsize(">" + fmt)
        count = self.count(size)
        return list(struct.iter_unpack(">" + fmt, self.raw(count * size))) if count else []

    def count(self, item_size: int) -> int:
        """Read a length prefix, checked against the bytes left (no huge allocations)."""
        count: int = self.one("I")
        if count * item_size > len(self._data) - self._pos:
            raise SecAggProtocolError("truncated secure-aggregation message")
        return count

    def finish(self) -> None:
        """Refuse trailing bytes: the message must be read to its end."""
        if self._pos != len(self._data):
            raise SecAggProtocolError("trailing bytes in secure-aggregation message")


def _w_setup(w: Writer, m: RoundSetup) -> None:
    w.pack("Q", m.round).ids(m.participants)
    w.pack("IBI", m.threshold, _GRAPHS.index(m.graph), m.degree)
    w.raw(m.graph_seed, 32).pack("dBd", m.clip_range, m.bits, m.max_weight)
    w.pack("B", _THREATS.index(m.threat_model))


def _r_setup(r: Reader) -> RoundSetup:
    round_id, participants = r.one("Q"), r.ids()
    threshold, graph, degree = r.unpack("IBI")
    if graph >= len(_GRAPHS):
        raise SecAggProtocolError(f"unknown graph code {graph}")
    seed = r.raw(32)
    clip, bits, max_weight = r.unpack("dBd")
    threat = r.one("B")
    if threat >= len(_THREATS):
        raise SecAggProtocolError(f"unknown threat model code {threat}")
    return RoundSetup(round_id, participants, threshold, _GRAPHS[graph], degree, seed,
                      clip, bits, max_weight, _THREATS[threat])


def _w_adv(w: Writer, m: KeyAdvertisement) -> None:
    w.raw(m.cipher, KEY_BYTES).raw(m.mask, KEY_BYTES).blob(m.signature)


def _r_adv(r: Reader) -> KeyAdvertisement:
    return KeyAdvertisement(r.raw(KEY_BYTES), r.raw(KEY_BYTES), r.blob())


_ENTRY = f"Q{KEY_BYTES}s{KEY_BYTES}s"


def write_entries(w: Writer, entries: Iterable[PublicKeys]) -> None:
    """Write the clients' public keys: a count, then each owner with its 32-byte cipher and mask keys."""
    rows = [(e.owner, e.cipher, e.mask) for e in entries]
    if any(len(c) != KEY_BYTES or len(k) != KEY_BYTES for _, c, k in rows):
        raise SecAggProtocolError("public keys must be 32 bytes")
    w.records(_ENTRY, rows)


def read_entries(r: Reader) -> tuple[PublicKeys, ...]:
    """Read the public keys :func:`write_entries` wrote."""
    return tuple(PublicKeys(*row) for row in r.records(_ENTRY))


def _w_dir(w: Writer, m: KeyDirectory) -> None:
    if m.signatures and len(m.signatures) != len(m.entries):
        raise SecAggProtocolError("a key directory needs one signature per entry, or none")
    write_entries(w, m.entries)
    w.records(f"{_SIG}s", [(s,) for s in m.signatures])


def _r_dir(r: Reader) -> KeyDirectory:
    entries = read_entries(r)
    return KeyDirectory(entries, tuple(s for (s,) in r.records(f"{_SIG}s")))


def _w_shares(w: Writer, shares: tuple[EncryptedShare, ...]) -> None:
    # Every ciphertext of a message has one length: store it once.
    lengths = {len(s.ciphertext) for s in shares} or {0}
    if len(lengths) != 1:
        raise SecAggProtocolError("share ciphertexts must all have the same length")
    size = lengths.pop()
    w.pack("H", size).records(f"QQ{size}s", [(s.sender, s.receiver, s.ciphertext) for s in shares])


def _r_shares(r: Reader) -> tuple[EncryptedShare, ...]:
    size = r.one("H")
    return tuple(EncryptedShare(*row) for row in r.records(f"QQ{size}s"))


def _w_reply(w: Writer, m: ShareKeysReply) -> None:
    _w_shares(w.raw(m.commitment, 32), m.shares)


def _r_reply(r: Reader) -> ShareKeysReply:
    commitment = r.raw(32)
    return ShareKeysReply(commitment, _r_shares(r))


def _w_masked(w: Writer, m: MaskedInput) -> None:
    vector = np.ascontiguousarray(m.vector)
    bits = vector.dtype.itemsize * 8
    if vector.ndim != 1 or vector.dtype != dtype_for(bits):
        raise SecAggProtocolError("a masked input must be a 1-D little-endian uint16/32/64 vector")
    w.pack("BQ", bits, vector.shape[0]).raw(vector.tobytes(), vector.nbytes)


def _r_masked(r: Reader) -> MaskedInput:
    bits, length = r.unpack("BQ")
    if bits not in RING_BITS:
        raise SecAggProtocolError(f"bad masked-input width {bits}")
    dtype = dtype_for(bits)
    return MaskedInput(np.frombuffer(r.raw(length * dtype.itemsize), dtype=dtype))


def _w_unmask_req(w: Writer, m: UnmaskRequest) -> None:
    w.ids(m.survivors).ids(m.dropped)
    w.records(f"Q{_SIG}s", [(s.signer, s.signature) for s in m.signatures])


def _r_unmask_req(r: Reader) -> UnmaskRequest:
    survivors, dropped = r.ids(), r.ids()
    return UnmaskRequest(survivors, dropped, tuple(SignedSurvivors(*row) for row in r.records(f"Q{_SIG}s")))


_REVEALED = f"Q{SHARE_BYTES}s"


def _w_revealed(w: Writer, shares: tuple[RevealedShare, ...]) -> None:
    w.records(_REVEALED, [(s.owner, s.value.to_bytes(SHARE_BYTES, "big")) for s in shares])


def _r_revealed(r: Reader) -> tuple[RevealedShare, ...]:
    return tuple(RevealedShare(o, int.from_bytes(v, "big")) for o, v in r.records(_REVEALED))


def _w_unmask(w: Writer, m: UnmaskReply) -> None:
    _w_revealed(w, m.self_mask_shares)
    _w_revealed(w, m.mask_key_shares)


def _r_unmask(r: Reader) -> UnmaskReply:
    return UnmaskReply(_r_revealed(r), _r_revealed(r))


_CODECS: dict[type, tuple[int, Callable[[Writer, Any], object], Callable[[Reader], Any]]] = {
    RoundSetup: (1, _w_setup, _r_setup),
    KeyAdvertisement: (2, _w_adv, _r_adv),
    KeyDirectory: (3, _w_dir, _r_dir),
    ShareKeysReply: (4, _w_reply, _r_reply),
    MaskedInputRequest: (5, lambda w, m: _w_shares(w, m.shares),
                         lambda r: MaskedInputRequest(_r_shares(r))),
    MaskedInput: (6, _w_masked, _r_masked),
    UnmaskRequest: (7, _w_unmask_req, _r_unmask_req),
    UnmaskReply: (8, _w_unmask, _r_unmask),
    ConsistencyRequest: (9, lambda w, m: w.ids(m.survivors), lambda r: ConsistencyRequest(r.ids())),
    ConsistencyReply: (10, lambda w, m: w.raw(m.signature, _SIG), lambda r: ConsistencyReply(r.raw(_SIG))),
}


def encode(message: object) -> bytes:
    """Canonical bytes of a protocol message."""
    tag, write, _ = _CODECS[type(message)]
    w = Writer().pack("BB", _VERSION, tag)
    write(w, message)
    return w.getvalue()


def decode(data: bytes, expected: type[T]) -> T:
    """Parse bytes into a message of type ``expected``."""
    tag, _, read = _CODECS[expected]
    r = Reader(data)
    if r.unpack("BB") != (_VERSION, tag):
        raise SecAggProtocolError(f"expected a {expected.__name__} message")
    message: T = read(r)
    r.finish()
    return message


def wire_size(message: object) -> int:
    """Return the encoded size in bytes (computed without copying a masked vector)."""
    if isinstance(message, MaskedInput):
        return 2 + 9 + int(message.vector.nbytes)
    return len(encode(message))


def setup_digest(setup: RoundSetup) -> bytes:
    """SHA-256 of the encoded round setup, bound into the session digest."""
    return hashlib.sha256(encode(setup)).digest()
