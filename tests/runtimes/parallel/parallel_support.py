"""Helpers shared by the data-parallel tests (a module of its own: every test folder has a conftest)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from core.instructions import client_seed
from learning.federation import build_federation
from learning.models import build_model, get_flat
from tests.conftest import wait_for

__all__ = ["ROOT", "Job", "wait_for", "reference_sync"]

ROOT = Path(__file__).resolve().parents[3]


class Job:
    """A ``python -m runtimes.parallel`` process in its own session."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen([sys.executable, "-m", "runtimes.parallel", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err

    def stop(self) -> None:
        """Kill whatever is left of the session this job started (its group id is the launcher's pid)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.communicate()


def reference_sync(scenario, world: int) -> np.ndarray:
    """Single-process SGD whose step t uses the concatenation of every rank's batch t.

    Rank r's batches in epoch e: its shard (its clients' training sets, round-robin) in the order
    randperm(client_seed(seed, e, r + 1)), cut into S = max_r ceil(n_r / b) nearly equal parts.
    """
    fed = build_federation(scenario.data, scenario.federation.clients, scenario.seed)
    shards = []
    for rank in range(world):
        parts = [fed.clients[c].train for c in range(rank, fed.num_clients, world)]
        shards.append((torch.from_numpy(np.concatenate([p.x for p in parts])),
                       torch.from_numpy(np.concatenate([p.y for p in parts]))))
    t = scenario.training
    model = build_model(scenario.model.name, fed.input_shape, fed.num_classes, seed=scenario.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum)
    steps = max(math.ceil(len(y) / t.batch_size) for _, y in shards)
    for epoch in range(1, scenario.rounds * t.local_epochs + 1):
        seeds = [client_seed(scenario.seed, epoch, r + 1) for r in range(world)]
        orders = [torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
                  for (_, y), seed in zip(shards, seeds, strict=True)]
        parts = [torch.tensor_split(o, steps) for o in orders]  # S nearly equal batches per rank
        for step in range(steps):
            xb = torch.cat([x[p[step]] for (x, _), p in zip(shards, parts, strict=True)])
            yb = torch.cat([y[p[step]] for (_, y), p in zip(shards, parts, strict=True)])
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
    return get_flat(model)
