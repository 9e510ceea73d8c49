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
from sqlalchemy import LargeBinary, String, delete, select
from sqlalchemy.dialects import mysql
from sqlalchemy.orm import Mapped, Session, mapped_column

from core.errors import StoreError
from core.strategy import ServerState
from runstore.base import Base

__all__ = ["CheckpointChunk", "Checkpoints", "FolderCheckpoints", "DatabaseCheckpoints", "UrlCheckpoints",
           "checkpoints_at", "checked_reference", "read_blob", "blob_exists", "blob_file", "blob_chunks", "url_chunks",
           "encode_state", "decode_state", "CHUNK_BYTES", "DB_PREFIX"]

#: The largest piece of a blob in one database row (PostgreSQL's ``bytea`` holds up to 1 GB; 8 MiB stays cheap).
CHUNK_BYTES = 8 * 2**20
#: How a checkpoint kept in the database is named in ``Round.checkpoint``.
DB_PREFIX = "db:"


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
        del session
        recorded = Path(reference)
        for candidate in (recorded, self.folder / recorded.parent.name / recorded.name):
            if candidate.suffix == ".safetensors" and candidate.is_file():
                return candidate.read_bytes()
        return None

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
        if not _chunk_seqs(session, reference):
            return None
        run_id, _, number = reference.removeprefix(DB_PREFIX).rpartition("/")
        rows = session.scalars(select(CheckpointChunk.data).where(
            CheckpointChunk.run_id == run_id, CheckpointChunk.round == int(number)).order_by(CheckpointChunk.seq))
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
    raise StoreError(f"round {server_round} of run {run_id} names its checkpoint {reference[:120]!r}, which is "
                     "not where a checkpoint of that round is written; refused")


def _url_inside(reference: str, url_root: str | None) -> tuple[Any, str]:
    """Return the filesystem and path of ``reference`` when it lies under this reader's ``url_root``.

    Raises
    ------
    StoreError
        No URL configured here, another scheme or root, or fsspec cannot open the scheme.
    """
    import fsspec

    if url_root is None:
        raise StoreError(f"checkpoint {reference[:120]} is in an object store: set QUORUM_CHECKPOINTS to its URL "
                         "to read it here")
    try:
        fs, path = fsspec.core.url_to_fs(reference)
        root_fs, root = fsspec.core.url_to_fs(url_root)
    except (ImportError, ValueError, OSError) as exc:
        raise StoreError(f"cannot open checkpoint {reference[:120]}: {exc}") from None
    if fs.protocol != root_fs.protocol or not str(path).startswith(str(root).rstrip("/") + "/"):
        raise StoreError(f"checkpoint {reference[:120]} is not under this store's checkpoints ({url_root}); refused")
    return fs, str(path)


def read_blob(session: Session, reference: str, folder: Path | None = None,
              url_root: str | None = None) -> bytes | None:
    """Return the checkpoint ``reference`` (checked by :func:`checked_reference`) names, wherever it was written.

    ``folder``: where this reader's store keeps checkpoint files, tried with
    the recorded file name when the recorded path does not exist (a store
    moved, a path relative to the aggregator's working directory);
    ``url_root``: the object store this reader may read (its
    ``QUORUM_CHECKPOINTS``). ``None`` when the checkpoint is gone.

    Raises
    ------
    StoreError
        The checkpoint cannot be read (a URL outside ``url_root``, a backend error), named.
    """
    try:
        if reference.startswith(DB_PREFIX):
            return DatabaseCheckpoints().read(session, reference)
        if "://" in reference:
            fs, path = _url_inside(reference, url_root)
            try:
                with fs.open(path, "rb") as handle:
                    return bytes(handle.read())
            except FileNotFoundError:
                return None
        found = blob_file(reference, folder)
        return None if found is None else found.read_bytes()
    except (OSError, ValueError, ImportError) as exc:
        raise StoreError(f"cannot read checkpoint {reference[:120]}: {exc}") from None


def blob_exists(session: Session, reference: str, folder: Path | None = None, url_root: str | None = None) -> bool:
    """Whether the checkpoint ``reference`` names is there, without reading it; False when it cannot be read."""
    try:
        if reference.startswith(DB_PREFIX):
            return bool(_chunk_seqs(session, reference))
        if "://" in reference:
            fs, path = _url_inside(reference, url_root)
            return bool(fs.exists(path))
        return blob_file(reference, folder) is not None
    except (StoreError, OSError, ValueError, ImportError):
        return False


def blob_file(reference: str, folder: Path | None = None) -> Path | None:
    """Return the file a folder checkpoint is in (to stream it from disk), or ``None`` for any other kind."""
    if reference.startswith(DB_PREFIX) or "://" in reference:
        return None
    recorded = Path(reference)
    base = folder if folder is not None else recorded.parent.parent
    for candidate in (recorded, base / recorded.parent.name / recorded.name):
        if candidate.suffix == ".safetensors" and candidate.is_file():
            return candidate
    return None


def _chunk_seqs(session: Session, reference: str) -> list[int]:
    """Return the chunk numbers a database checkpoint holds, in order; all of them or none (``[]``)."""
    match = re.fullmatch(r"db:(.+)/([0-9]{1,9})", reference, re.ASCII)
    if match is None:
        raise StoreError(f"malformed checkpoint reference {reference[:120]!r}")
    seqs = list(session.scalars(select(CheckpointChunk.seq).where(
        CheckpointChunk.run_id == match[1], CheckpointChunk.round == int(match[2])).order_by(CheckpointChunk.seq)))
    if seqs and seqs != list(range(len(seqs))):
        raise StoreError(f"checkpoint {reference}: chunks {seqs[:5]}... are not all there")
    return seqs


def blob_chunks(session_factory: Callable[[], Session], reference: str) -> Iterator[bytes]:
    """Yield a database checkpoint's chunks in order, one row at a time (a served model is never whole in memory).

    Raises
    ------
    StoreError
        Before the first chunk: the checkpoint is malformed or incomplete.
    """
    run_id, _, number = reference.removeprefix(DB_PREFIX).rpartition("/")
    with session_factory() as s:
        seqs = _chunk_seqs(s, reference)  # checked here, before anything is sent

    def chunks() -> Iterator[bytes]:
        for seq in seqs:
            with session_factory() as s:
                piece = s.get(CheckpointChunk, (run_id, int(number), seq))
                if piece is None:  # there is no way to delete a run's checkpoints: this would be a crash
                    raise StoreError(f"checkpoint {reference}: chunk {seq} went while it was read")
                yield piece.data

    return chunks()


def url_chunks(reference: str, url_root: str | None) -> Iterator[bytes]:
    """Yield an object-store checkpoint in pieces of :data:`CHUNK_BYTES` (a served model is never whole in memory).

    Raises
    ------
    StoreError
        Before the first piece: the object is outside ``url_root`` or cannot be opened.
    """
    fs, path = _url_inside(reference, url_root)
    try:
        handle = fs.open(path, "rb")
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot read checkpoint {reference[:120]}: {exc}") from None

    def pieces() -> Iterator[bytes]:
        with handle:
            while piece := handle.read(CHUNK_BYTES):
                yield bytes(piece)

    return pieces()
