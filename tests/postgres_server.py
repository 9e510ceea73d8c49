"""A real PostgreSQL server for the tests, on 127.0.0.1 at a free port.

Debian's PostgreSQL (``make system`` installs it where it is missing): ``initdb``
makes a fresh cluster in a folder of its own under ``/tmp`` (pytest's folders are
closed to other accounts), ``pg_ctl start -w`` returns once the
server accepts connections, and ``pg_ctl stop -m fast`` ends it by the PID in
its ``postmaster.pid``; a postmaster still alive after that (or after a start
that timed out) is killed by that PID. PostgreSQL
refuses to run as root, so as root (CI, the sessions) both run as the
``postgres`` account the package creates, which owns the folder.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deploy.loopback import free_ports

__all__ = ["postgres_bin", "postgres_server"]

USER = "quorum"  # the cluster's superuser, trusted on loopback only


def postgres_bin(name: str) -> str:
    """The path of PostgreSQL's ``name`` (``initdb``, ``pg_ctl``): Debian keeps them off PATH."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or [shutil.which(name) or ""]
    if not found[-1]:
        raise FileNotFoundError(f"PostgreSQL's {name} is not installed (make system: apt-get install postgresql)")
    return found[-1]


def _as_owner(argv: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


@contextmanager
def postgres_server() -> Iterator[str]:
    """Start a PostgreSQL server in a new folder; yield its SQLAlchemy URL; stop it by PID, remove the folder."""
    folder = Path(tempfile.mkdtemp(prefix="qpg-"))
    try:
        with _server(folder) as url:
            yield url
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _server(folder: Path) -> Iterator[str]:
    data, log = folder / "pgdata", folder / "postgres.log"
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(folder, owner.pw_uid, owner.pw_gid)
    (port,) = free_ports(1)
    subprocess.run(_as_owner([postgres_bin("initdb"), "-D", str(data), "-U", USER, "--auth=trust", "-E", "UTF8",
                              "--no-sync"]), check=True, capture_output=True, timeout=120)
    options = f"-p {port} -c listen_addresses=127.0.0.1 -k {folder} -c fsync=off"
    try:
        subprocess.run(_as_owner([postgres_bin("pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "-w",
                                  "-t", "60", "start"]), check=True, capture_output=True, timeout=90)
        yield f"postgresql+psycopg://{USER}@127.0.0.1:{port}/postgres"
    finally:
        _stop(data)


def _stop(data: Path) -> None:
    """Stop the server of ``data`` (``pg_ctl stop -m fast``), and SIGKILL its postmaster if that did not end it."""
    pid_file = data / "postmaster.pid"
    pid = int(pid_file.read_text().split()[0]) if pid_file.exists() else None
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run(_as_owner([postgres_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60", "stop"]),
                       capture_output=True, timeout=90)
    if pid is not None and _alive(pid):
        os.kill(pid, signal.SIGKILL)  # its backends exit with it


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for this sandbox's init to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
