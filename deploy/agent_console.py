"""What a device's owner sees of the agent: each task's outcome, the connection, and setup mistakes.

The agent's children write to their logs (``.quorum-agent/logs/``); the
console relays the lines that matter (a task's outcome with its reason or
metrics, the SuperNode's node id once connected), and reads the SuperNode's
log when it exits to tell a setup mistake (a busy port, a CA that does not
verify, a refused key) from a transient failure (:mod:`deploy.preflight`).
"""

from __future__ import annotations

import contextlib
import re
import socket
import time
from pathlib import Path
from typing import Any

from deploy.preflight import ACTIVATION_GRACE_S, SupernodeDiagnosis, agent_running

__all__ = ["AgentConsole", "Relay", "reply_summary", "public_reason", "agent_report", "unreachable"]

#: What the SuperNode logs once the SuperLink accepted it.
CONNECTED = "SuperNode ID: "
#: What Flower's SuperNode logs before it retries a lost connection (then its wait in seconds).
RETRYING = "Connection attempt failed, retrying in "
#: How often a lost connection's cause is probed again (each probe may take a second).
PROBE_EVERY_S = 10.0
#: How often a connected agent marks its session as alive (``WORKDIR/session``'s mtime).
SESSION_TOUCH_S = 10.0

#: A file path in an error message: absolute (``/home/...``, ``C:\\...``), from home or ``.``, or relative
#: with a file name (``data/local.csv``). Not a cell's text such as ``n/a`` or ``km/h``: no path starts
#: inside a word, and a relative one needs a file name's extension.
_PATH = re.compile(r"(?<![\w.~/\\-])(?:[A-Za-z]:[/\\]+|~?/(?=[\w.~-])|\.{1,2}[/\\]+"
                   r"|(?=[\w.~-]+[/\\][\w.~/\\-]*\.[A-Za-z]\w*))[\w.~/\\-]*")
#: The data file an error message starts with, once its folders are hidden (or when it had none).
_LEADING_FILE = re.compile(r"^(?:<path>|[\w.~-]+\.[A-Za-z]\w*): ")


def public_reason(exc: BaseException, limit: int = 200) -> str:
    """Return what a failed task tells the aggregator: the error's type and a short message.

    Never the device's file paths or its data's column lists (the device's own
    console and log keep the whole message). The data file a message starts
    with (``<path>: line 5, ...``) is left out: the aggregator knows it as this
    device's file.
    """
    text = _LEADING_FILE.sub("", _PATH.sub("<path>", str(exc)))
    parts = text.split(",")
    if len(parts) > 6:
        text = ",".join(parts[:4]) + ", ..."
    return f"{type(exc).__name__}: {text}"[:limit]


def reply_summary(reply: Any) -> str:
    """`` (train, loss 0.412, num-examples 40)``: the kind of message and the numbers it carries back.

    A refusal under the site policy says ``(refused: <the rules>)``.
    """
    if reply is None:
        return ""
    from core.replies import refusal_reason

    with contextlib.suppress(Exception):
        if reply.has_error():  # an error reply (e.g. from a mod) is not a completed task
            refused = refusal_reason(reply.error)
            if refused is not None:
                return f" (refused: {refused})"
            return f" (answered with an error: {reply.error.reason})"
    kind = str(getattr(getattr(reply, "metadata", None), "message_type", "") or "")
    numbers = []
    with contextlib.suppress(Exception):  # a reply is the ClientApp's: show what can be shown
        for record in reply.content.metric_records.values():
            numbers += [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in list(record.items())[:4]
                        if isinstance(v, (int, float))]
    parts = [p for p in (kind, *numbers[:4]) if p]
    return f" ({', '.join(parts)})" if parts else ""



class Relay:
    """Shows the device's owner what its children log that matters: each task's outcome, the connection.

    ``marks`` maps a log to its ``(mark, template)`` pairs: a line holding a
    mark is said as the template filled with what follows the mark (or by the
    template itself, when it is a function of that text).
    """

    def __init__(self, marks: dict[Path, list[tuple[str, Any]]], say: Any) -> None:
        self.marks, self.say = marks, say
        self.offsets = {path: path.stat().st_size if path.exists() else 0 for path in marks}

    def poll(self) -> set[str]:
        """Relay what the logs said since the last call; returns the marks seen."""
        seen: set[str] = set()
        for path, pairs in self.marks.items():
            try:
                with path.open("rb") as handle:
                    handle.seek(self.offsets[path])
                    chunk = handle.read(1 << 20)
            except OSError:
                continue
            complete = chunk[: chunk.rfind(b"\n") + 1]  # whole lines only; the rest is read next time
            if not complete and len(chunk) == 1 << 20:
                complete = chunk  # a megabyte without a newline (a progress bar): skip it, do not stall
            self.offsets[path] += len(complete)
            for line in complete.decode("utf-8", errors="replace").splitlines():
                for mark, template in pairs:
                    if mark in line:
                        seen.add(mark)
                        rest = line.split(mark, 1)[1].strip()
                        self.say(template(rest) if callable(template) else template.format(rest))
        return seen


class AgentConsole:
    """The agent's voice: relayed log lines, and the verdict on each child's exit."""

    def __init__(self, logs: Path, name: str, say: Any, server: str = "") -> None:
        self.say, self.server = say, server
        self.relay = Relay({logs / "worker.log": [("quorum-worker: ", "{}")],
                            logs / "supernode.log": [(CONNECTED, "connected to the aggregator as node {}"),
                                                     (RETRYING, self._retrying)]},
                           say)
        log = logs / "supernode.log"  # read from here on: what earlier agents logged is not this one's problem
        self.diagnosis = SupernodeDiagnosis(log, name, offset=log.stat().st_size if log.exists() else 0)
        self.logs = logs
        # touched while the SuperNode is connected: a key refused with no recent session is refused for good
        self.session = logs.parent / "session"
        self.connected, self.touched = False, 0.0
        self.cause, self.probed_at = "", -PROBE_EVERY_S  # why the aggregator was last unreachable, and when

    def poll(self) -> None:
        """Relay the children's new log lines and track whether the SuperNode is connected.

        While connected, the session file is touched every ``SESSION_TOUCH_S``.
        """
        seen = self.relay.poll()
        if CONNECTED in seen:
            self.connected = True
        if RETRYING in seen:
            self.connected = False  # the session ends as the connection does
        if self.connected and time.monotonic() - self.touched > SESSION_TOUCH_S:
            self._touch()

    def _retrying(self, rest: str) -> str:
        """Say that the SuperNode lost the aggregator: the cause (a connection attempt of our own) and the countdown."""
        seconds = rest.split()[0] if rest else ""
        where = f"the aggregator at {self.server}" if self.server else "the aggregator"
        if self.server and time.monotonic() - self.probed_at > PROBE_EVERY_S:  # a retry storm probes once
            self.cause, self.probed_at = unreachable(self.server), time.monotonic()
        cause = f" ({self.cause})" if self.cause else ""
        wait = f"retrying in {float(seconds):.0f} s" if _is_number(seconds) else "retrying"
        return f"{where} is unreachable{cause}; {wait}"

    def _touch(self) -> None:
        with contextlib.suppress(OSError):
            self.session.touch()
        self.touched = time.monotonic()

    def recent_session(self) -> bool:
        """Whether this device was connected within the SuperLink's grace for an old session."""
        try:
            return time.time() - self.session.stat().st_mtime < ACTIVATION_GRACE_S
        except OSError:
            return False

    def after_exit(self, role: str, code: int | None, restarts: int, max_restarts: int | None,
                   backoff: float) -> int | None:
        """Return the agent's exit code when ``role``'s exit ends it (said in one line), else ``None`` (restart it).

        3: the SuperNode's log shows a fatal cause; 1: more than ``max_restarts`` restarts.
        """
        fatal = None
        if role == "supernode":
            if self.connected:
                self._touch()  # the session ended now; the SuperLink drops it within ACTIVATION_GRACE_S
                self.connected = False
            fatal = self.diagnosis.after_exit(recent_session=self.recent_session())
        if fatal is not None:
            self.say(f"error: {fatal}")
            return 3
        cause = f": {self.diagnosis.cause}" if role == "supernode" and self.diagnosis.cause else ""
        if max_restarts is not None and restarts > max_restarts:
            self.say(f"{role} exited (rc {code}){cause}; giving up after {max_restarts} restarts")
            return 1
        self.say(f"{role} exited (rc {code}){cause}; restarting in {backoff:.0f} s "
                 f"(see {self.logs / (role + '.log')})")
        return None


def unreachable(server: str, timeout_s: float = 1.0) -> str:
    """Why a TCP connection to ``server`` (HOST:PORT) fails right now, or that it does not."""
    host, _, port = server.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return "the port answers: the aggregator's front door is up, the SuperLink behind it may not be"
    except (OSError, ValueError) as exc:
        return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def agent_report(workdir: Path, tasks: int = 10) -> dict[str, Any]:
    """Return what ``quorum client status`` shows: is the agent running, its node id, its last tasks' outcomes."""
    logs = workdir / "logs"
    node = _last_after(logs / "supernode.log", "SuperNode ID: ", 1)
    return {"workdir": str(workdir), "running": agent_running(workdir),
            "node_id": node[0] if node else None,
            "tasks": _last_after(logs / "worker.log", "quorum-worker: ", tasks)}


def _last_after(path: Path, mark: str, count: int) -> list[str]:
    """Return the text after ``mark`` on the last ``count`` lines of ``path`` that hold it (the last MB read)."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - (1 << 20)))
            lines = handle.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
    found = [line.split(mark, 1)[1].strip() for line in lines if mark in line]
    return found[-count:]
