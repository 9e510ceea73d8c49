"""What a checkpoint reader checks before it serves a byte: the reference, the file, the framing.

A reader opens only what a round writes (:func:`checked_reference`; an
object-store URL only under its own root, :func:`url_inside`), and a
checkpoint file beneath its folder without following a symbolic link, and
serves what it opened (:func:`checked_file`, through
``runstore.checkpoints.open_blob``); it checks the safetensors framing, the
header and the length, before the first byte (:func:`check_frame`): a
damaged checkpoint is refused in one line, never served in part. Where a
checkpoint is kept (a folder, the database, an object store) is
``runstore/checkpoints.py``'s.
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from core.errors import StoreError

__all__ = ["Blob", "check_frame", "checked_file", "checked_object", "checked_reference", "url_inside", "handle_blob",
           "read_all", "damaged", "CHUNK_BYTES", "DB_PREFIX", "MAX_HEADER_BYTES"]

#: The largest piece of a blob read at a time, and in one database row (PostgreSQL's ``bytea`` holds up to 1 GB;
#: 8 MiB stays cheap).
CHUNK_BYTES = 8 * 2**20
#: How a checkpoint kept in the database is named in ``Round.checkpoint``.
DB_PREFIX = "db:"
#: The longest safetensors header a checkpoint may claim (the safetensors library's own bound, 100 MB).
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class Blob:
    """A checkpoint opened and checked before any byte of it is read: its length, then its bytes in order.

    ``pieces`` reads from what was opened (a file descriptor, an object's
    handle, the database's rows), never from a path opened again;
    ``release`` lets go of it when the pieces are not all read.
    """

    size: int
    pieces: Iterator[bytes]
    release: Callable[[], None]

    def read(self) -> bytes:
        """Return the whole blob, then let go of what was opened."""
        try:
            return b"".join(self.pieces)
        finally:
            self.release()


def check_frame(prefix: Callable[[int], bytes], total: int, name: str) -> None:
    """Check a safetensors blob of ``total`` bytes from its header alone.

    ``prefix(n)`` returns the blob's first ``n`` bytes. The safetensors
    framing: 8 bytes, a little-endian length ``N`` of at most
    :data:`MAX_HEADER_BYTES`; ``N`` bytes of JSON, an object giving each
    tensor's ``data_offsets`` ``[begin, end]`` in the data section that
    follows; the tensors cover that section exactly, so ``total`` is
    ``8 + N + max(end)``.

    Raises
    ------
    StoreError
        ``<name> is damaged: <why>``, one line.
    """
    length = _header_length(prefix, total, name)
    data = total - 8 - length
    header = _header(_exactly(prefix, 8 + length, name)[8:], name)
    end = max((_tensor_end(key, entry, data, name) for key, entry in header.items() if key != "__metadata__"),
              default=0)
    if end != data:
        raise damaged(name, f"it holds {total:,} bytes, its header describes {8 + length + end:,}")


def damaged(name: str, why: str) -> StoreError:
    """Return the one-line error for the checkpoint ``name``, damaged as ``why`` says."""
    return StoreError(f"{name} is damaged: {why}")


def _exactly(prefix: Callable[[int], bytes], n: int, name: str) -> bytes:
    """Return the first ``n`` bytes (fewer: the blob shrank while it was read)."""
    head = prefix(n)
    if len(head) != n:
        raise damaged(name, f"{len(head):,} bytes could be read of the first {n:,}")
    return head


def _header_length(prefix: Callable[[int], bytes], total: int, name: str) -> int:
    """Return the header's length ``N``, bounded and within the blob."""
    if total < 8:
        raise damaged(name, f"it holds {total:,} bytes, fewer than the 8 giving its header's length")
    (length,) = struct.unpack("<Q", _exactly(prefix, 8, name))
    if length > MAX_HEADER_BYTES:
        raise damaged(name, f"its header claims {length:,} bytes, more than the {MAX_HEADER_BYTES:,} allowed")
    if 8 + length > total:
        raise damaged(name, f"it holds {total:,} bytes, its header needs {8 + length:,}")
    return int(length)


def _header(raw: bytes, name: str) -> dict[str, Any]:
    """Return the header's JSON object."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise damaged(name, f"its header is not JSON ({str(exc)[:120]})") from None
    if not isinstance(header, dict):
        raise damaged(name, f"its header is a JSON {type(header).__name__}, not an object")
    return header


def _tensor_end(key: str, entry: Any, data: int, name: str) -> int:
    """Return where a tensor ends in the data section of ``data`` bytes, which its offsets must lie in."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise damaged(name, f"tensor {key[:60]!r} has no data_offsets [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data:
        raise damaged(name, f"tensor {key[:60]!r} lies at bytes {begin:,} to {end:,} of a data section of {data:,}")
    return int(end)


def _checked(handle: BinaryIO, size: int, name: str) -> tuple[BinaryIO, int]:
    """Return an opened blob and its size once its framing is checked, rewound; closed when it is not whole."""
    def prefix(n: int) -> bytes:
        handle.seek(0)
        return bytes(handle.read(n))

    try:
        check_frame(prefix, size, name)
        handle.seek(0)
    except BaseException:
        handle.close()
        raise
    return handle, size


def read_all(handle: BinaryIO) -> bytes:
    """Return everything ``handle`` holds, then close it."""
    with handle:
        return bytes(handle.read())


def _handle_pieces(handle: BinaryIO) -> Iterator[bytes]:
    with handle:
        while piece := handle.read(CHUNK_BYTES):
            yield bytes(piece)


def handle_blob(opened: tuple[BinaryIO, int] | None) -> Blob | None:
    """Return the checked handle and size ``opened`` as a :class:`Blob` read in pieces (``None`` stays ``None``)."""
    if opened is None:
        return None
    handle, size = opened
    return Blob(size, _handle_pieces(handle), handle.close)


def checked_file(reference: str, folder: Path | None, name: str) -> tuple[BinaryIO, int] | None:
    """Open and check a folder checkpoint: under the recorded folder, else under ``folder``; ``None``: gone."""
    recorded = Path(reference)
    if recorded.suffix != ".safetensors":
        return None
    for root in dict.fromkeys((recorded.parent.parent, folder or recorded.parent.parent)):
        fd = _open_beneath(root, (recorded.parent.name, recorded.name), name)
        if fd is not None:
            return _checked(*_regular(fd, name), name)
    return None


def _open_beneath(root: Path, parts: tuple[str, ...], name: str) -> int | None:
    """Open ``root/<parts>``, following no symbolic link below ``root``; ``None``: not there.

    Each part is opened relative to the one above it (``openat``), so what
    is read is what was checked: a link swapped in afterwards is not followed.
    """
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    for depth, part in enumerate(parts, start=1):
        try:  # a FIFO must not block the reader: O_NONBLOCK, then fstat refuses it
            below = _open_at(fd, part, os.O_NONBLOCK if depth == len(parts) else os.O_DIRECTORY, name)
        finally:
            os.close(fd)
        if below is None:
            return None
        fd = below
    return fd


def _open_at(dir_fd: int, part: str, flags: int, name: str) -> int | None:
    try:
        return os.open(part, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise StoreError(f"{name} is not a regular file: {part[:60]} is a symbolic link; refused") from None
        raise StoreError(f"{name} cannot be opened: {part[:60]}: {exc.strerror}") from None


def _regular(fd: int, name: str) -> tuple[BinaryIO, int]:
    """Return the opened file and its size when it is a regular file (not a folder, a device, a FIFO)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise StoreError(f"{name} is not a regular file; refused")
    return os.fdopen(fd, "rb"), info.st_size


def checked_object(fs: Any, path: str, name: str) -> tuple[BinaryIO, int] | None:
    """Open and check an object; its size is the opened handle's own (no second look-up). ``None``: gone."""
    try:
        handle = fs.open(path, "rb")
    except FileNotFoundError:
        return None
    try:
        size = int(handle.seek(0, io.SEEK_END))
    except BaseException:
        handle.close()
        raise
    return _checked(handle, size, name)


def checked_reference(reference: str, run_id: str, server_round: int) -> str:
    """Return ``reference`` when it has a shape this module writes for round ``server_round`` of ``run_id``.

    ``db:<run>/<round>``, or a path or URL ending in ``<run>/round-NNNNN.safetensors`` with no ``..``:
    a row that names anything else (``/etc/passwd``, another run's file) is refused, so a reader never
    opens what a round did not write.

    Raises
    ------
    StoreError
        Any other reference, named.
    """
    tail = f"/{run_id}/round-{server_round:05d}.safetensors"
    if reference == f"{DB_PREFIX}{run_id}/{server_round}":
        return reference
    if ("/" + reference).endswith(tail) and ".." not in reference.split("/") and not reference.startswith(DB_PREFIX):
        return reference
    raise StoreError(f"round {server_round} of run {run_id} names its checkpoint {reference[:400]!r}, which is "
                     "not where a checkpoint of that round is written; refused")


def url_inside(reference: str, url_root: str | None) -> tuple[Any, str]:
    """Return the filesystem and path of ``reference`` when it lies under this reader's ``url_root``.

    Raises
    ------
    StoreError
        No URL configured here, another scheme or root, or fsspec cannot open the scheme.
    """
    import fsspec

    if url_root is None:
        raise StoreError(f"checkpoint {reference[:400]} is in an object store: set QUORUM_CHECKPOINTS to its URL "
                         "to read it here")
    try:
        fs, path = fsspec.core.url_to_fs(reference)
        root_fs, root = fsspec.core.url_to_fs(url_root)
    except (ImportError, ValueError, OSError) as exc:
        raise StoreError(f"cannot open checkpoint {reference[:400]}: {exc}") from None
    if fs.protocol != root_fs.protocol or not str(path).startswith(str(root).rstrip("/") + "/"):
        raise StoreError(f"checkpoint {reference[:400]} is not under this store's checkpoints ({url_root}); refused")
    return fs, str(path)
