"""In-cluster data-parallel mode: the federated machinery on ``torch.distributed``.

Inside one organisation's cluster there is no privacy boundary between
workers, so the same scenario, model, data and aggregation core train one
model over many processes or machines (``torchrun``; gloo on CPU). Two modes:

- **sync**: every step, each rank's gradient sum and batch size (the core's
  :class:`~core.aggregate.MeanState`) are all-reduced as one flat buffer and
  finalized into the weighted mean gradient (:mod:`.sync`);
- **localsgd**: the federated round itself, with the ranks as its transport:
  local epochs or steps per client, updates folded and merged through the
  core, the scenario's strategy applied (:mod:`.localsgd`).

Rank 0 commits rounds to the run store (``engine = "parallel"``). See
``docs/parallel.md``. Names are loaded on first use, so importing the package
(e.g. for the CLI) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Comm", "JobSpec", "LaunchFailed", "LaunchSpec", "Mode", "ParallelError", "SyncSGD",
           "WorkerLost", "WorkerStopped", "launch", "torchrun_command"]

_HOMES = {
    "Comm": "comm", "JobSpec": "job", "LaunchFailed": "errors", "LaunchSpec": "launch", "Mode": "mode",
    "ParallelError": "errors", "SyncSGD": "sync", "WorkerLost": "errors", "WorkerStopped": "errors",
    "launch": "launch", "torchrun_command": "launch",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
