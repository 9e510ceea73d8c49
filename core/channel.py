"""The hand-off on an edge aggregator's host: its upstream ClientApp asks, its edge ServerApp answers.

In a deployment an edge aggregator is a device of the aggregator (a
SuperNode enrolled with it) and an aggregator of its own devices (its own
SuperLink). Flower starts a fresh ClientApp process for every message the
aggregator sends the edge; that process hands the message to the edge's
long-lived ServerApp, which runs it over the edge's devices, through a folder
on the edge's host, and waits for the answer.

Under the channel's root::

    runs/<run>.json          the aggregator's scenario (its run config's scenario keys, nothing else)
    requests/<run>/<id>.msg  a message to answer: Flower's protobuf ``RecordDict``, with a header record
    replies/<id>.msg         its answer
    names.json               the edge's device names, kept current by its supervisor

Every file is written whole and renamed into place, so neither side reads
half a message, and a request is claimed by an atomic rename, so two
servers never run one. A request carries its deadline (wall clock: two
processes); one taken past it is dropped unanswered, an answer past it is
not written, an asker that gives up removes its request, and the edge's
supervisor sweeps what is left (:meth:`Channel.sweep`). Both processes run as the edge host's own user: the folder is
not a boundary against its owner (``docs/hierarchy.md``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from core.errors import EdgeUnavailable

__all__ = ["Channel", "Request"]

_HEADER = "quorum-channel"
_FAILED = "quorum-channel-failed"
_SUFFIX = ".msg"


@dataclass(frozen=True)
class Request:
    """A message taken from the channel: its id, kind (the Flower message type), content and deadline."""

    id: str
    run: int
    kind: str
    content: RecordDict
    deadline: float  # time.time() after which nobody waits for the answer


@dataclass(frozen=True)
class Channel:
    """The hand-off folder ``root`` (created on first use)."""

    root: Path

    # -- the asking side: the edge's upstream ClientApp ------------------------------------------------------

    def ask(self, run: int, kind: str, content: RecordDict, timeout_s: float,
            run_config: Mapping[str, Any] | None = None, poll_s: float = 0.05) -> RecordDict:
        """Hand ``content`` (a message of type ``kind`` of the aggregator's run ``run``) over; return the answer.

        ``run_config`` is recorded once per run (:meth:`run_config`): the edge
        serves the run with the aggregator's scenario.

        Raises
        ------
        EdgeUnavailable
            No answer within ``timeout_s`` (the request is withdrawn), or the
            edge's ServerApp answered that it failed (:meth:`fail`), with its reason.
        """
        if run_config is not None and not self._run_file(run).exists():
            _write(self._run_file(run), json.dumps(dict(run_config)).encode())
        rid = uuid.uuid4().hex
        deadline = time.time() + timeout_s
        message = RecordDict({**dict(content.items()),
                              _HEADER: ConfigRecord({"kind": kind, "run": int(run), "deadline": float(deadline)})})
        request = self.root / "requests" / str(int(run)) / f"{rid}{_SUFFIX}"
        _write(request, recorddict_to_proto(message).SerializeToString())
        reply = self.root / "replies" / f"{rid}{_SUFFIX}"
        while time.time() < deadline:
            if reply.exists():
                content = _read(reply)
                reply.unlink(missing_ok=True)
                failed = content.get(_FAILED)
                if isinstance(failed, ConfigRecord):
                    raise EdgeUnavailable(str(failed.get("reason", "the edge's ServerApp failed")))
                return content
            time.sleep(poll_s)
        request.unlink(missing_ok=True)
        raise EdgeUnavailable(f"the edge's ServerApp did not answer a {kind} message of run {run} within "
                              f"{timeout_s:g} s (is the edge aggregator serving it? see its logs/serverapp-*.log)")

    # -- the answering side: the edge's ServerApp ------------------------------------------------------------

    def run_config(self, run: int) -> dict[str, Any] | None:
        """Return the run config the asker recorded for ``run`` (``None``: no message of it came yet)."""
        path = self._run_file(run)
        return json.loads(path.read_text()) if path.exists() else None

    def waiting_runs(self) -> list[int]:
        """Return the runs that have a request waiting, oldest request's run first."""
        oldest: dict[int, float] = {}
        for path in (self.root / "requests").glob(f"*/*{_SUFFIX}"):
            with contextlib.suppress(OSError, ValueError):
                run, mtime = int(path.parent.name), path.stat().st_mtime
                oldest[run] = min(mtime, oldest.get(run, mtime))
        return sorted(oldest, key=oldest.__getitem__)

    def take(self, run: int) -> Request | None:
        """Take ``run``'s oldest waiting request (``None``: none); requests past their deadline are dropped.

        A request is claimed by renaming it out of the queue first, so of two
        servers of one run only one gets it; one that cannot be read (withdrawn,
        or not a message) is dropped.
        """
        folder = self.root / "requests" / str(int(run))
        if not folder.is_dir():
            return None
        paths = sorted(folder.glob(f"*{_SUFFIX}"), key=lambda p: _mtime(p))
        for path in paths:
            claimed = path.with_name(f".{path.name}.{os.getpid()}.taken")
            try:
                os.rename(path, claimed)  # atomic: a second server's rename of the same file fails
            except OSError:  # withdrawn by its asker, or taken by another server
                continue
            try:
                content = _read(claimed)
            except Exception:  # not a message (protobuf's DecodeError is no ValueError): dropped
                continue
            finally:
                claimed.unlink(missing_ok=True)
            header = content.get(_HEADER)
            if not isinstance(header, ConfigRecord):
                continue
            deadline = float(header.get("deadline", 0.0))  # type: ignore[arg-type]
            if deadline <= time.time():
                continue  # nobody waits for it any more
            del content[_HEADER]
            return Request(path.name.removesuffix(_SUFFIX), int(run), str(header.get("kind")), content, deadline)
        return None

    def answer(self, request: Request, content: RecordDict) -> None:
        """Hand ``content`` back as the answer to ``request``; nothing once its asker stopped waiting (its deadline)."""
        if time.time() > request.deadline:
            return
        _write(self.root / "replies" / f"{request.id}{_SUFFIX}", recorddict_to_proto(content).SerializeToString())

    # -- the edge host's housekeeping ------------------------------------------------------------------------

    def sweep(self, older_than_s: float = 3600.0) -> int:
        """Remove what nobody will read: answers, requests and half-written files older than ``older_than_s``.

        Returns how many files went. An asker waits at most a message's time to
        live, so an answer an hour old is one whose asker gave up (or died).
        """
        cutoff, gone = time.time() - older_than_s, 0
        for pattern in (f"replies/*{_SUFFIX}", f"requests/*/*{_SUFFIX}", "**/.*.tmp", "**/.*.taken"):
            for path in self.root.glob(pattern):
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < cutoff:
                        path.unlink()
                        gone += 1
        return gone

    def publish_names(self, names: Mapping[int, str]) -> None:
        """Record the edge's device names (node id -> enrolled name), for its ServerApps to read on each query."""
        text = json.dumps({str(int(k)): str(v) for k, v in names.items()}, sort_keys=True)
        path = self.root / "names.json"
        if not path.exists() or path.read_text() != text:
            _write(path, text.encode())

    def device_names(self) -> dict[int, str]:
        """Return the names :meth:`publish_names` last recorded (empty when none could be read)."""
        try:
            raw = json.loads((self.root / "names.json").read_text())
            return {int(k): str(v) for k, v in raw.items()}
        except (OSError, ValueError, AttributeError):
            return {}

    def fail(self, request: Request, reason: str) -> None:
        """Answer ``request`` with the reason it could not be run: its asker raises it."""
        if time.time() > request.deadline:
            return
        content = RecordDict({_FAILED: ConfigRecord({"reason": reason})})
        _write(self.root / "replies" / f"{request.id}{_SUFFIX}", recorddict_to_proto(content).SerializeToString())

    def _run_file(self, run: int) -> Path:
        return self.root / "runs" / f"{int(run)}.json"


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole: a temporary file beside it, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read(path: Path) -> RecordDict:
    proto = ProtoRecordDict()
    proto.ParseFromString(path.read_bytes())
    return recorddict_from_proto(proto)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")
