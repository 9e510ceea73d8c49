"""Process bookkeeping for the runtime tests: the loopback federation's, plus logs for failures.

:class:`deploy.loopback.Processes` starts every process in a
session of its own with an environment tag that all its descendants inherit
(Flower's SuperExec children detach into sessions of their own and Ray's
workers are re-parented to init, but both keep the tag), so teardown finds
every one of them by PID and nothing is ever killed by name. The tests add
the virtual environment's ``bin`` to ``PATH``, since Flower starts
``flower-superexec`` and ``flwr-*`` by name, and print the logs of what they
started when something fails.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.loopback import Processes as LoopbackProcesses
from deploy.loopback import Started, free_ports

__all__ = ["VENV_BIN", "Processes", "Started", "free_ports", "describe"]

VENV_BIN = Path(sys.executable).parent


def describe(pids: Sequence[int]) -> str:
    """One line per PID: its command line, for an assertion message."""
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{pid}: {cmdline[:200]}")
    return "\n".join(lines)


@dataclass
class Processes(LoopbackProcesses):
    """The processes one test started; ``stop_all`` ends them and their descendants."""

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> Started:
        path = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
        return super().start(name, argv, {**path, **(env or {})}, cwd)

    def logs(self, lines: int = 60) -> str:
        """The last ``lines`` of every started process's log."""
        return "\n\n".join(f"===== {s.name} (pid {s.popen.pid}, rc {s.popen.poll()}) =====\n"
                           + ("\n".join(s.text().splitlines()[-lines:]) or "(no log)")
                           for s in self.started)
