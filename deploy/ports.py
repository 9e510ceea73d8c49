"""The aggregator host's ports: whether one is free, and which process holds it when it is not.

A front door whose nginx master was killed leaves its worker listening; a
restart that fails with "Address already in use" must say which process that
is. The holder is found the way ``ss -ltnp`` finds it: the listening socket's
inode in ``/proc/net/tcp`` (and ``tcp6``), then the process with that socket
among its open files (root sees every process; another user only its own).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

__all__ = ["port_free", "wait_port_free", "port_holders", "describe_holders"]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (``SO_REUSEADDR``: a socket in TIME_WAIT does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_port_free(host: str, port: int, timeout_s: float) -> bool:
    """Poll until ``host:port`` is free (True) or ``timeout_s`` passed (False); ``0`` checks once."""
    deadline = time.monotonic() + timeout_s
    while not port_free(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _listening_inodes(port: int, proc: Path) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def port_holders(port: int, proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """Return ``(pid, command line)`` of each process listening on TCP ``port``, lowest pid first.

    Empty when nothing listens there, or the holders cannot be seen (another
    user's process, no ``/proc``).
    """
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port, proc)}
    found = []
    for entry in proc.iterdir() if wanted else ():
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(entry / "fd")
            held = any(os.readlink(entry / "fd" / fd) in wanted for fd in fds)
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if held:
            found.append((int(entry.name), command[:200] or "?"))
    return sorted(found)


def describe_holders(port: int) -> str:
    """Say who holds ``port``: ``held by pid 123 (nginx: worker process)``, or that it cannot be seen."""
    holders = port_holders(port)
    if not holders:
        return "held by a process this user cannot see (try: ss -ltnp)"
    return "held by " + ", ".join(f"pid {pid} ({command})" for pid, command in holders)
