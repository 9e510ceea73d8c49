"""Factories for the data-parallel tests: small scenario files and jobs run as real processes.

Every job runs in its own session (process group); a job still alive when its
test ends is killed through that group, by the launcher's pid, so no test
leaves workers behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from parallel_support import ROOT, Job

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


@pytest.fixture
def start_job() -> Iterator[Callable[[list[str]], Job]]:
    jobs: list[Job] = []

    def start(args: list[str]) -> Job:
        jobs.append(Job(args, ROOT))
        return jobs[-1]

    yield start
    for job in jobs:
        job.stop()
