"""Factories for the data-parallel tests: small scenario files and jobs run as real processes.

Every job runs in its own session (process group); a job still alive when its
test ends is killed through that group, by the launcher's pid, so no test
leaves workers behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

DIGITS = """\
name = "{name}"
seed = {seed}
rounds = {rounds}
[data]
dataset = "digits"
partition = "{partition}"
alpha = 0.5
[model]
name = "{model}"
[federation]
clients = {clients}
fraction = {fraction}
[training]
local_epochs = {epochs}
batch_size = {batch_size}
lr = {lr}
momentum = {momentum}
[strategy]
name = "{strategy}"
[evaluation]
federated = {federated}
server = true
"""

DEFAULTS = dict(name="digits-small", seed=7, rounds=2, partition="dirichlet", model="logreg", clients=4,
                fraction=1.0, epochs=1, batch_size=16, lr=0.1, momentum=0.5, strategy="fedavg",
                federated="true")


@pytest.fixture
def scenario_file(tmp_path: Path) -> Callable[..., Path]:
    """Write a small digits scenario; keyword arguments override ``DEFAULTS``."""

    def write(**overrides: object) -> Path:
        path = tmp_path / f"scenario-{len(list(tmp_path.glob('scenario-*')))}.toml"
        path.write_text(DIGITS.format(**{**DEFAULTS, **overrides}))
        return path

    return write


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'runs' / 'quorum.db'}"


class Job:
    """A ``python -m aggregator.parallel`` process in its own session."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen([sys.executable, "-m", "aggregator.parallel", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def stop(self) -> None:
        """Kill whatever is left of the session this job started (its group id is the launcher's pid)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.communicate()


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[Callable[[list[str]], Job]]:
    jobs: list[Job] = []

    def start(args: list[str]) -> Job:
        jobs.append(Job(args, ROOT))
        return jobs[-1]

    yield start
    for job in jobs:
        job.stop()


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> object:
    """Poll ``predicate`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
