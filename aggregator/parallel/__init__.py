"""In-cluster data-parallel mode: the federated machinery on ``torch.distributed``.

Inside one organisation's cluster there is no privacy boundary between
workers, so the same scenario, model, data and aggregation core train one
model over many processes or machines (``torchrun``; gloo on CPU). Two modes:

- **sync**: every step, each rank's gradient sum and batch size (the core's
  :class:`~aggregator.core.MeanState`) are all-reduced as one flat buffer and
  finalized into the weighted mean gradient (:mod:`.sync`);
- **localsgd**: the federated round itself, with the ranks as its transport:
  local epochs or steps per client, deltas folded and merged through the core,
  the scenario's strategy applied (:mod:`.localsgd`).

Rank 0 commits rounds to the run store (``engine = "parallel"``). See
``docs/parallel.md``.
"""

from aggregator.parallel.comm import Comm
from aggregator.parallel.errors import LaunchFailed, ParallelError, WorkerLost, WorkerStopped
from aggregator.parallel.job import JobSpec, Mode
from aggregator.parallel.launch import LaunchSpec, launch, torchrun_command
from aggregator.parallel.sync import SyncSGD

__all__ = ["Comm", "JobSpec", "LaunchFailed", "LaunchSpec", "Mode", "ParallelError", "SyncSGD",
           "WorkerLost", "WorkerStopped", "launch", "torchrun_command"]
