"""Process bookkeeping for the runtime tests: start, tag, log, and stop by PID.

Every process a runtime test starts gets its own session (so its process
group can be signalled without touching anything else) and an environment
tag, ``QUORUM_TEST_TAG=<uuid>``, that all its descendants inherit: Flower's
SuperExec children detach into sessions of their own and Ray's workers are
re-parented to init, but both keep the tag, so teardown can find every one
of them by PID and nothing is ever killed by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TAG_ENV = "QUORUM_TEST_TAG"
VENV_BIN = Path(sys.executable).parent


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def tagged_pids(tag: str) -> list[int]:
    """Live (non-zombie) processes whose environment carries ``QUORUM_TEST_TAG=tag``."""
    needle = f"{TAG_ENV}={tag}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def describe(pids: Sequence[int]) -> str:
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{pid}: {cmdline[:200]}")
    return "\n".join(lines)


@dataclass
class Started:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


@dataclass
class Processes:
    """The processes one test started; :meth:`stop_all` ends them and their descendants."""

    workdir: Path
    tag: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: list[Started] = field(default_factory=list)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env[TAG_ENV] = self.tag
        # Flower starts `flower-superexec` / `flwr-*` by name: they must be on PATH.
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra or {})
        return env

    def start(self, name: str, argv: Sequence[str], extra_env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> Started:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env(extra_env), cwd=cwd or self.workdir, start_new_session=True)
        started = Started(name, popen, log)
        self.started.append(started)
        return started

    def logs(self) -> str:
        return "\n\n".join(f"===== {s.name} (pid {s.popen.pid}, rc {s.popen.poll()}) =====\n{s.tail()}"
                           for s in self.started)

    def alive(self) -> list[int]:
        return tagged_pids(self.tag)

    def stop_all(self, grace_s: float = 20.0) -> list[int]:
        """SIGTERM what we started and every tagged descendant, then SIGKILL stragglers.

        Returns the PIDs that had to be killed with SIGKILL.
        """
        for s in reversed(self.started):
            if s.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(s.popen.pid, signal.SIGTERM)  # its own group: start_new_session
        for pid in self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for s in self.started:
                s.popen.poll()  # reap our direct children
            if not self.alive():
                break
            time.sleep(0.2)
        stubborn = self.alive()
        for pid in stubborn:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for s in self.started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.popen.wait(timeout=5)
        deadline = time.monotonic() + 5
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        return stubborn
