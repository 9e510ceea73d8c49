"""Where a run's checkpoints live: a folder, the database itself, or an fsspec URL, chosen by one setting.

A checkpoint is one ``safetensors`` blob per committed round: the global model
(``params``), the server optimiser's slots (``slot.<name>``) and, in its
metadata, the round and the wrappers' state. Where it is kept decides who
can read it:

* a **folder** (``/path``, or ``file:///path``): the default beside a SQLite
  store; written to a temporary name and renamed, then the round row is
  committed, so a crash leaves the whole round or none of it;
* the **database** (``db``): the default for a server store (PostgreSQL), so
  a standby aggregator or a dashboard on another host reads every
  checkpoint through the same URL as the runs. The blob is written in chunks
  of :data:`CHUNK_BYTES` rows of the ``checkpoint_chunks`` table, in the
  same transaction as its round;
* any other **fsspec URL** (``s3://bucket/prefix``, ``memory://``): an object
  store, written like the folder.

``Round.checkpoint`` holds where the blob went: a path, ``db:<run>/<round>``,
or the URL; a reader finds it from that alone (:func:`read_blob`), whatever
its own store would write to.

A reader opens a file without following a symbolic link (:func:`open_blob`)
and serves what it opened, and checks the safetensors framing, the header
and the length, before the first byte (:func:`check_frame`): a damaged
checkpoint is refused in one line, never served in part.
"""

from __future__ import annotations

import json
import re
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save
from sqlalchemy import LargeBinary, String, delete, func, select
from sqlalchemy.dialects import mysql
from sqlalchemy.orm import Mapped, Session, mapped_column

from core.errors import StoreError
from core.strategy import ServerState
from runstore.base import Base
from runstore.blobs import (
    CHUNK_BYTES,
    DB_PREFIX,
    Blob,
    check_frame,
    checked_file,
    checked_object,
    damaged,
    handle_blob,
    read_all,
    url_inside,
)

__all__ = ["CheckpointChunk", "Checkpoints", "FolderCheckpoints", "DatabaseCheckpoints", "UrlCheckpoints",
           "checkpoints_at", "read_blob", "open_blob", "encode_state", "decode_state"]



class CheckpointChunk(Base):
    """One piece of a checkpoint kept in the database: run, round, its place in the blob, its bytes."""

    __tablename__ = "checkpoint_chunks"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    round: Mapped[int] = mapped_column(primary_key=True)
    seq: Mapped[int] = mapped_column(primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary().with_variant(mysql.LONGBLOB(), "mysql"))  # BLOB: 64 KiB


def encode_state(state: ServerState, where: str) -> bytes:
    """Return ``state`` as one safetensors blob.

    Raises
    ------
    StoreError
        A tensor holds NaN or Inf values (the round loop refuses such a step; this keeps any other writer honest).
    """
    tensors = {"params": state.params, **{f"slot.{k}": v for k, v in state.slots.items()}}
    bad = [k for k, v in tensors.items() if not np.isfinite(v).all()]
    if bad:
        raise StoreError(f"refusing to save {where}: {', '.join(bad)} hold NaN or Inf values")
    meta = {"round": str(state.round), "extra": json.dumps(state.wrapper_state)}  # "extra": the stored name, kept
    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=meta)


def decode_state(data: bytes, where: str) -> ServerState:
    """Return the ``ServerState`` of a safetensors blob.

    Raises
    ------
    StoreError
        The blob is not a readable checkpoint, naming ``where`` it came from.
    """
    try:
        tensors = load(data)
        (length,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + length]).get("__metadata__") or {}
        state = ServerState(params=tensors["params"],
                            slots={k.removeprefix("slot."): v for k, v in tensors.items() if k.startswith("slot.")},
                            round=int(meta.get("round", 0)), wrapper_state=json.loads(meta.get("extra", "{}")))
    except (SafetensorError, struct.error, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"cannot read checkpoint {where}: {exc}") from None
    return state


class Checkpoints(ABC):
    """Where one store keeps its checkpoints."""

    @abstractmethod
    def write(self, session: Session, run_id: str, server_round: int, blob: bytes) -> str:
        """Keep ``blob`` as the checkpoint of ``server_round``; return what ``Round.checkpoint`` records.

        ``session`` is the transaction that commits the round: a backend that
        writes elsewhere has already made the blob durable when it returns.
        """

    @abstractmethod
    def read(self, session: Session, reference: str) -> bytes | None:
        """Return the blob ``reference`` names, or ``None`` when it is gone."""

    def describe(self) -> str:
        """Name where the checkpoints go, for messages."""
        return type(self).__name__


@dataclass(frozen=True)
class FolderCheckpoints(Checkpoints):
    """One file per round under ``folder/<run>/``, renamed into place before its round commits."""

    folder: Path

    def write(self, session: Session, run_id: str, server_round: int, blob: bytes) -> str:
        """Write ``round-NNNNN.safetensors`` through a temporary file and a rename."""
        del session
        path = self.folder / run_id / f"round-{server_round:05d}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        tmp.replace(path)
        return str(path)

    def read(self, session: Session, reference: str) -> bytes | None:
        """Read the recorded path, or the same file name in this folder (a store moved, a relative path)."""
        return read_blob(session, reference, folder=self.folder)

    def describe(self) -> str:
        """Return the folder."""
        return str(self.folder)


@dataclass(frozen=True)
class DatabaseCheckpoints(Checkpoints):
    """Chunks of :data:`CHUNK_BYTES` in the store's own ``checkpoint_chunks`` table, in the round's transaction."""

    def write(self, session: Session, run_id: str, server_round: int, blob: bytes) -> str:
        """Add the chunks to the round's transaction (a round written again replaces its chunks)."""
        session.execute(delete(CheckpointChunk).where(CheckpointChunk.run_id == run_id,
                                                      CheckpointChunk.round == server_round))
        for seq, start in enumerate(range(0, max(len(blob), 1), CHUNK_BYTES)):
            session.add(CheckpointChunk(run_id=run_id, round=server_round, seq=seq,
                                        data=blob[start:start + CHUNK_BYTES]))
        return f"{DB_PREFIX}{run_id}/{server_round}"

    def read(self, session: Session, reference: str) -> bytes | None:
        """Join the chunks in order; ``None`` when the round has none."""
        if not _chunk_lengths(session, reference, f"checkpoint {reference[:400]}"):
            return None
        run_id, number = _chunk_key(reference)
        rows = session.scalars(select(CheckpointChunk.data).where(
            CheckpointChunk.run_id == run_id, CheckpointChunk.round == number).order_by(CheckpointChunk.seq))
        return b"".join(rows)

    def describe(self) -> str:
        """Return ``the database``."""
        return "the database"


@dataclass(frozen=True)
class UrlCheckpoints(Checkpoints):
    """One object per round under an fsspec URL (``s3://bucket/prefix``, ``memory://``), like the folder."""

    url: str

    def _fs(self) -> tuple[Any, str]:
        import fsspec  # an object store's own package (s3fs, ...) loads only when a store is configured so

        fs, root = fsspec.core.url_to_fs(self.url)
        return fs, str(root).rstrip("/")

    def write(self, session: Session, run_id: str, server_round: int, blob: bytes) -> str:
        """Write the object through a temporary name, then move it into place."""
        del session
        fs, root = self._fs()
        path = f"{root}/{run_id}/round-{server_round:05d}.safetensors"
        fs.makedirs(f"{root}/{run_id}", exist_ok=True)
        with fs.open(path + ".tmp", "wb") as out:
            out.write(blob)
        fs.mv(path + ".tmp", path)
        return fs.unstrip_protocol(path)  # type: ignore[no-any-return]

    def read(self, session: Session, reference: str) -> bytes | None:
        """Read the object the reference names, when it lies under this URL; ``None`` when it is gone."""
        return read_blob(session, reference, url_root=self.url)

    def describe(self) -> str:
        """Return the URL."""
        return self.url


def checkpoints_at(where: str | Path | None, store_url: str) -> Checkpoints:
    """Return the checkpoints ``where`` names for the store at ``store_url``.

    ``None``: a folder ``checkpoints/`` beside a SQLite store, the database
    itself for any other (a server store is shared: so are its checkpoints).
    ``"db"``: the database. A ``scheme://`` URL: fsspec (``file://`` is a
    folder). Anything else: a folder.

    Raises
    ------
    StoreError
        An empty setting.
    """
    if where is None:
        if store_url.startswith("sqlite:///"):
            return FolderCheckpoints(Path(store_url.removeprefix("sqlite:///")).parent / "checkpoints")
        return DatabaseCheckpoints()
    text = str(where).strip()
    if not text:
        raise StoreError("checkpoints: an empty setting; give a folder, \"db\" or a URL (s3://bucket/prefix)")
    if text == "db":
        return DatabaseCheckpoints()
    if text.startswith("file://"):
        return FolderCheckpoints(Path(text.removeprefix("file://")))
    if "://" in text:
        return UrlCheckpoints(text)
    return FolderCheckpoints(Path(text))


def read_blob(session: Session, reference: str, folder: Path | None = None,
              url_root: str | None = None) -> bytes | None:
    """Return the checkpoint ``reference`` (checked by :func:`checked_reference`) names, wherever it was written.

    ``folder``: where this reader's store keeps checkpoint files, tried with
    the recorded file name when the recorded path does not exist (a store
    moved, a path relative to the aggregator's working directory);
    ``url_root``: the object store this reader may read (its
    ``QUORUM_CHECKPOINTS``). A file is opened as :func:`open_blob` opens it;
    the bytes are returned only when their framing is whole (:func:`check_frame`).
    ``None`` when the checkpoint is gone.

    Raises
    ------
    StoreError
        The checkpoint cannot be read (a URL outside ``url_root``, a symbolic link, a backend error) or is
        damaged, named.
    """
    name = f"checkpoint {reference[:400]}"
    try:
        if reference.startswith(DB_PREFIX):
            data = DatabaseCheckpoints().read(session, reference)
            if data is not None:
                check_frame(lambda n: data[:n], len(data), name)
            return data
        opened = (checked_object(*url_inside(reference, url_root), name) if "://" in reference
                  else checked_file(reference, folder, name))
        return None if opened is None else read_all(opened[0])
    except (OSError, ValueError, ImportError) as exc:
        raise StoreError(f"cannot read checkpoint {reference[:400]}: {exc}") from None


def open_blob(session_factory: Callable[[], Session], reference: str, folder: Path | None = None,
              url_root: str | None = None, name: str | None = None) -> Blob | None:
    """Open the checkpoint ``reference`` names and check its framing (:func:`check_frame`) before any byte is read.

    A file is opened beneath its checkpoints folder (the recorded one, else
    ``folder``) following no symbolic link there (neither the run's folder nor
    the file) and must be a regular file; a database checkpoint is checked
    from its chunks' lengths and first bytes, one row at a time after that
    (a served model is never whole in memory); an object from its opened
    handle. ``name`` names it in messages (default: ``checkpoint <reference>``).

    Returns
    -------
    Blob or None
        ``None`` when the checkpoint is gone, or lies in an object store this reader was not told of.

    Raises
    ------
    StoreError
        It is damaged, is not a regular file, or cannot be read: one line, naming it.
    """
    name = name or f"checkpoint {reference[:400]}"
    try:
        if reference.startswith(DB_PREFIX):
            return _chunk_blob(session_factory, reference, name)
        if "://" in reference:
            return _object_blob(reference, url_root, name)
        return handle_blob(checked_file(reference, folder, name))
    except (OSError, ValueError) as exc:  # the error's words, not its path (a dashboard shows this line)
        raise StoreError(f"{name} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None


def _object_blob(reference: str, url_root: str | None, name: str) -> Blob | None:
    try:
        fs, path = url_inside(reference, url_root)
    except (StoreError, ImportError):
        return None  # an object store this reader was not told of, or outside it: nothing it may open
    return handle_blob(checked_object(fs, path, name))


def _chunk_key(reference: str) -> tuple[str, int]:
    """Return the run and round a database checkpoint reference names."""
    match = re.fullmatch(r"db:(.+)/([0-9]{1,9})", reference, re.ASCII)
    if match is None:
        raise StoreError(f"malformed checkpoint reference {reference[:400]!r}")
    return match[1], int(match[2])


def _chunk_lengths(session: Session, reference: str, name: str) -> list[int]:
    """Return the lengths of a database checkpoint's chunks, in order, without reading them; ``[]``: none."""
    run_id, number = _chunk_key(reference)
    rows = session.execute(select(CheckpointChunk.seq, func.length(CheckpointChunk.data)).where(
        CheckpointChunk.run_id == run_id, CheckpointChunk.round == number).order_by(CheckpointChunk.seq)).all()
    missing = next((i for i, (seq, _) in enumerate(rows) if seq != i), None)
    if missing is not None:
        raise damaged(name, f"its chunk {missing} is missing")
    return [int(length) for _, length in rows]


def _chunk_prefix(session_factory: Callable[[], Session], run_id: str, number: int,
                  lengths: list[int]) -> Callable[[int], bytes]:
    """Return a reader of a database checkpoint's first bytes, from as few rows (and bytes of them) as it needs."""
    def prefix(n: int) -> bytes:
        head = bytearray()
        with session_factory() as s:
            for seq, length in enumerate(lengths):
                if len(head) >= n:
                    break
                if length:
                    head += s.scalar(select(func.substr(CheckpointChunk.data, 1, min(n - len(head), length),
                                                        type_=LargeBinary)).where(
                        CheckpointChunk.run_id == run_id, CheckpointChunk.round == number,
                        CheckpointChunk.seq == seq)) or b""
        return bytes(head)

    return prefix


def _chunk_blob(session_factory: Callable[[], Session], reference: str, name: str) -> Blob | None:
    """Check a database checkpoint from its chunks' lengths and first bytes; its pieces are its rows, in order."""
    run_id, number = _chunk_key(reference)
    with session_factory() as s:
        lengths = _chunk_lengths(s, reference, name)
    if not lengths:
        return None
    check_frame(_chunk_prefix(session_factory, run_id, number, lengths), sum(lengths), name)
    return Blob(sum(lengths), _chunk_pieces(session_factory, run_id, number, len(lengths), name), _holds_nothing)


def _holds_nothing() -> None:
    """Release a database checkpoint's pieces: no session stays open between two of them."""


def _chunk_pieces(session_factory: Callable[[], Session], run_id: str, number: int, count: int,
                  name: str) -> Iterator[bytes]:
    for seq in range(count):
        with session_factory() as s:
            piece = s.scalar(select(CheckpointChunk.data).where(
                CheckpointChunk.run_id == run_id, CheckpointChunk.round == number, CheckpointChunk.seq == seq))
        if piece is None:  # there is no way to delete a run's checkpoints: this would be a crash
            raise StoreError(f"{name}: chunk {seq} went while it was read")
        yield piece
