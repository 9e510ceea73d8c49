"""What ``quorum client start`` checks before it joins, and how it reads a SuperNode that keeps exiting.

A setup mistake on a device used to look like every other: an endless
``supernode exited ...; restarting``. Here each one becomes one line naming
the fix, and the agent exits non-zero instead of looping:

- a busy local port (``--runtime-port``; unset, a free one is picked);
- a CA file that does not verify the aggregator's certificate (checked with a
  TLS handshake before the SuperNode starts);
- a key the aggregator refuses (not enrolled, or revoked): the SuperNode's log
  says ``Failed to activate SuperNode``, and this device was not connected in
  the last :data:`ACTIVATION_GRACE_S` (or the refusals last longer than a
  restart after a crash can explain).

An aggregator that cannot be reached is not a mistake: the agent says so and
keeps retrying with its back-off. A data file the built-in tasks would trip
on (no ``label`` column, unscaled features) is a warning at start, not a
refusal: a task of the user's own may read it differently.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from deploy.errors import DeployError
from learning.datafiles import csv_header, read_csv, read_npz
from learning.errors import DataError

__all__ = ["PreflightError", "check_data", "lock_workdir", "agent_running", "free_port", "check_port", "check_ca",
           "SupernodeDiagnosis", "ACTIVATION_GRACE_S", "last_error"]

#: A device restarted right after a crash is refused until the SuperLink drops its old session
#: (two missed 30 s heartbeats, docs/deploy.md); refusals for longer mean the key itself is refused.
ACTIVATION_GRACE_S = 90.0


#: OpenSSL's X509_V_ERR_CERT_NOT_YET_VALID and X509_V_ERR_CERT_HAS_EXPIRED: time, not the wrong CA.
_CLOCK_ERRORS = (9, 10)


class PreflightError(DeployError):
    """A setup mistake on the device: one line that names the fix."""


def lock_workdir(workdir: Path) -> IO[str]:
    """Hold ``workdir/agent.lock`` for this agent's life: two agents never share logs and Flower state.

    Raises
    ------
    PreflightError
        Another agent holds it.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    handle = (workdir / "agent.lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise PreflightError(f"--workdir {workdir}: another client agent runs there; give this one its own "
                             "--workdir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")  # for `quorum client status`
    handle.flush()
    return handle


def agent_running(workdir: Path) -> int | None:
    """Return the pid of the agent that holds ``workdir``'s lock, or ``None`` when none does.

    0 when the lock is held but its file names no pid.
    """
    path = workdir / "agent.lock"
    if not path.exists():
        return None
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            text = handle.read().strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(handle, fcntl.LOCK_UN)
    return None


def free_port() -> int:
    """Return a free TCP port on 127.0.0.1, chosen by the kernel."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check_port(port: int, option: str = "--runtime-port") -> None:
    """Raise :class:`PreflightError` when ``127.0.0.1:port`` is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the SuperNode binds: TIME_WAIT is free
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise PreflightError(f"{option} {port}: the port is in use on 127.0.0.1 ({exc.strerror}; another "
                                 f"client agent?): pick another, or leave {option} unset for a free one") from None


def _host_port(server: str) -> tuple[str, int]:
    host, sep, port = server.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise PreflightError(f"--server {server!r}: expected HOST:PORT, e.g. fl.example.org:9443")
    return host.strip("[]"), int(port)


def check_ca(server: str, ca: Path, timeout_s: float = 5.0) -> str | None:
    """Try a TLS handshake with the aggregator, verified by ``ca``.

    Returns ``None`` when the certificate verifies, or a warning when the
    aggregator cannot be reached (the agent retries).

    Raises
    ------
    PreflightError
        ``ca`` is no certificate, or does not verify the aggregator's certificate for that host.
    """
    host, port = _host_port(server)
    try:
        context = ssl.create_default_context(cafile=str(ca))  # only ca.pem, as the SuperNode trusts only it
    except (ssl.SSLError, OSError) as exc:
        raise PreflightError(f"--ca {ca}: not a PEM certificate ({exc}); copy ca.pem from the aggregator") from None
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=host):
            return None
    except ssl.SSLCertVerificationError as exc:
        if exc.verify_code in _CLOCK_ERRORS:  # a device clock not yet synced, or a certificate to renew
            return (f"the aggregator's certificate at {server} is {exc.verify_message}: check this device's "
                    "clock (NTP), or renew the aggregator's certificate; the agent keeps trying")
        raise PreflightError(
            f"--ca {ca} does not verify the aggregator's certificate at {server} ({exc.verify_message}): copy "
            "ca.pem from the aggregator and check its fingerprint against the one `quorum aggregator start` "
            "printed") from None
    except (OSError, ssl.SSLError) as exc:
        return f"cannot reach the aggregator at {server} yet ({exc}); the agent keeps trying"


@dataclass
class SupernodeDiagnosis:
    """Reads the SuperNode's log each time it exits; says when to stop restarting and why."""

    log: Path
    name: str = ""
    grace_s: float = ACTIVATION_GRACE_S
    offset: int = 0
    refused_since: float | None = field(default=None)
    cause: str = ""  # why it exited this time, when its log says (shown with the restart)

    def after_exit(self, now: float | None = None, recent_session: bool = True) -> str | None:
        """Return the fatal reason in what the SuperNode logged since its last exit, or ``None`` to restart it.

        ``recent_session``: this device's key may still hold a session at the
        SuperLink (it was connected within :data:`ACTIVATION_GRACE_S`), so a
        refusal may be the old session's; without one, the first refusal is the key's.
        """
        now = time.monotonic() if now is None else now
        try:
            with self.log.open("rb") as handle:
                handle.seek(self.offset)
                text = handle.read().decode("utf-8", errors="replace")
                self.offset = handle.tell()
        except OSError:
            return None
        self.cause = last_error(text)
        if "address already in use" in text.lower():
            return ("a local port of the SuperNode is in use (another client agent on this machine?): "
                    "pick another --runtime-port, or leave it unset for a free one")
        if "CERTIFICATE_VERIFY_FAILED" in text and "expired" not in text and "not yet valid" not in text:
            return "the aggregator's certificate does not verify against --ca: copy ca.pem from the aggregator"
        if "Failed to activate SuperNode" not in text:
            self.refused_since = None
            return None
        self.refused_since = self.refused_since if self.refused_since is not None else now
        if recent_session and now - self.refused_since < self.grace_s:
            left = self.grace_s - (now - self.refused_since)
            self.cause = (f"the aggregator refused this device's key (revoked or not enrolled, or this device's "
                          f"previous session is still open: trying {left:.0f} s more before giving up)")
            return None
        who = self.name or "NAME"
        waited = f" (for {now - self.refused_since:.0f} s)" if recent_session else ""
        return (f"the aggregator refuses this device's key{waited}: it is not "
                "enrolled, it was revoked, or another SuperNode with this key is still connected (an old agent, "
                f"a cloned device). To enroll it, on the aggregator: quorum client enroll {who} --public-key "
                "<this key's .pub>; a revoked device needs a new key first (quorum client keygen NEW.key)")


#: A log line that says why a process ended: its level, or an exception's ``Name: message``.
_ERROR_LINE = re.compile(r"\b(?:ERROR|CRITICAL)\b|\b\w*(?:Error|Exception)\b:")
#: What precedes a log line's message: a timestamp and a level (``2026-01-02 10:00:00 ERROR : ``).
_LOG_PREFIX = re.compile(r"^.*?\b(?:ERROR|CRITICAL|WARNING|INFO|DEBUG)\b\s*:?\s*")


def last_error(text: str, limit: int = 160) -> str:
    """Return the last line of ``text`` (a process's log since it started) that says what went wrong.

    The line comes without its timestamp and level, cut to ``limit``
    characters; ``""`` when no line does.
    """
    lines = [line.strip() for line in text.splitlines() if _ERROR_LINE.search(line)]
    if not lines:
        return ""
    line = _LOG_PREFIX.sub("", lines[-1]) if re.search(r"\b(?:ERROR|CRITICAL)\b", lines[-1]) else lines[-1]
    return line if len(line) <= limit else line[: limit - 3] + "..."


#: A feature beyond this magnitude is almost certainly unscaled (raw 0-255 pixels, raw incomes, ...).
UNSCALED_ABOVE = 50.0


def check_data(path: Path, label_column: str = "label", sample_rows: int = 2000) -> list[str]:
    """Warnings about a device's data file that the built-in tasks would trip on, each naming the fix.

    A CSV is read as its task reads it (:func:`learning.datasets.read_csv`), so
    a bad cell is located here exactly as the task's error will locate it (the
    line as an editor numbers it, the column by name); an NPZ too
    (:func:`learning.datafiles.read_npz`: sizes checked against the cap before
    anything is decompressed or allocated), and its first ``sample_rows``
    examples are looked at for scale. Text (a ``.txt`` file or a folder)
    is left to its task. Never fatal: a task of the user's own may read other columns.
    """
    suffix = path.suffix.lower()
    if path.is_dir() or suffix not in (".csv", ".npz"):
        return []
    if suffix == ".npz":
        try:
            x, _ = read_npz(path)  # within the cap and checked, as its task reads it: never np.load
        except DataError as exc:  # "<path>: example 3, feature 1: 1e+39 is beyond float32's range ..."
            return [f"--data {exc}"]
        features = np.asarray(x[:sample_rows], dtype=np.float64)
        return _scale_warning(path, features.reshape(len(features), -1), None)
    names = csv_header(path)
    if names and label_column not in names:
        shown = ", ".join(names[:5]) + (f", ... ({len(names)} columns)" if len(names) > 5 else "")
        return [f"--data {path}: no '{label_column}' column (it has {shown}): name the label column "
                f"'{label_column}', or set [data] label_column in the scenario"]
    try:
        features_named, x, _ = read_csv(path, label_column)
    except DataError as exc:  # the task's own words: "<path>: line 5, column 'mean_radius': 'n/a' is not a number..."
        return [f"--data {exc}"]
    return _scale_warning(path, x, features_named)


def _scale_warning(path: Path, x: np.ndarray, names: list[str] | None) -> list[str]:
    """Warn of the feature of largest magnitude, when it is beyond :data:`UNSCALED_ABOVE`: its name and range."""
    if not x.size:
        return []
    with np.errstate(invalid="ignore"):
        top = np.nanmax(np.where(np.isfinite(x), np.abs(x), np.nan), axis=0)
    unscaled = np.flatnonzero(np.nan_to_num(top) > UNSCALED_ABOVE)
    if not unscaled.size:
        return []
    worst = int(unscaled[np.argmax(top[unscaled])])
    column = x[:, worst][np.isfinite(x[:, worst])]
    what = f"feature {names[worst]!r}" if names else f"x[..., {worst}]"
    others = unscaled.size - 1
    more = f" (and {others} more feature{'s' if others > 1 else ''} beyond ±{UNSCALED_ABOVE:g})" if others else ""
    return [f"--data {path}: {what} ranges from {float(column.min()):g} to {float(column.max()):g}{more}: unscaled "
            "features make training diverge; set [data] standardize = \"federated\" in the scenario (as "
            "scenarios/devices.toml does), or scale every feature to about unit size"]
