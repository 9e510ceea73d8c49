"""Launch a data-parallel job on this machine: torchrun's elastic agent, run in-process.

:func:`launch` is what ``quorum parallel`` calls. It checks the scenario,
creates the run in the store (so a job that dies before its first round still
shows as failed), then starts ``nproc`` workers with torchrun's own machinery
(``torch.distributed.launcher.elastic_launch``: a c10d rendezvous on a free
local port, as ``torchrun --standalone`` does) and waits. When a worker dies
the agent stops the others (or restarts the whole group, up to
``max_restarts`` times, and the workers resume from the last committed
round); the failure comes back as one :class:`LaunchFailed` naming each failed
rank, its pid and its exit code or signal, and the run is marked failed with
that message. :func:`torchrun_command` gives the equivalent command line.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from aggregator.parallel.errors import LaunchFailed, ParallelError
from aggregator.parallel.job import Mode
from aggregator.parallel.runlog import create_run, run_info
from aggregator.parallel.shards import assign_clients
from aggregator.simulation import RunSummary, summarize
from aggregator.store import RunStore, default_db_url
from scenarios.schema import Scenario

__all__ = ["LaunchSpec", "check_spec", "worker_args", "torchrun_command", "launch", "describe_failures"]

WORKER_MODULE = "aggregator.parallel.worker"
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LaunchSpec:
    """A data-parallel job on this machine (see ``quorum parallel --help``)."""

    scenario: Path
    nproc: int = 2
    mode: Mode = Mode.SYNC
    local_steps: int = 0
    db: str = default_db_url()
    rounds: int | None = None
    seed: int | None = None
    timeout_s: float = 120.0
    bucket_mb: float = 25.0
    threads: int = 0
    max_restarts: int = 0
    resume: str | None = None
    pid_dir: Path | None = None


def check_spec(spec: LaunchSpec) -> Scenario:
    """Validate the job before any process starts; returns the scenario with overrides applied."""
    from aggregator.parallel.worker import load_job_scenario

    for key, value, ok in (("nproc", spec.nproc, spec.nproc >= 1), ("local_steps", spec.local_steps, spec.local_steps >= 0),
                           ("timeout", spec.timeout_s, spec.timeout_s > 0), ("bucket_mb", spec.bucket_mb, spec.bucket_mb > 0),
                           ("max_restarts", spec.max_restarts, spec.max_restarts >= 0)):
        if not ok:
            raise ParallelError(f"{key} = {value!r}: out of range")
    if spec.local_steps and spec.mode is not Mode.LOCALSGD:
        raise ParallelError(f"local_steps = {spec.local_steps}: only the localsgd mode takes local steps")
    scenario = load_job_scenario(spec.scenario, spec.rounds, spec.seed)
    assign_clients(scenario.federation.clients, spec.nproc)
    if scenario.secagg.enabled:
        raise ParallelError(f"{spec.scenario}: secagg.enabled = true: secure aggregation protects clients from "
                            "the aggregator; inside one cluster there is no such boundary, turn it off to run parallel")
    return scenario


def worker_args(spec: LaunchSpec, run_id: str | None) -> list[str]:
    """The worker's command-line arguments."""
    args = ["--scenario", str(spec.scenario), "--mode", spec.mode.value, "--local-steps", str(spec.local_steps),
            "--db", spec.db, "--timeout", f"{spec.timeout_s:g}", "--bucket-mb", f"{spec.bucket_mb:g}",
            "--threads", str(spec.threads)]
    for flag, value in (("--rounds", spec.rounds), ("--seed", spec.seed), ("--run-id", run_id),
                        ("--pid-dir", spec.pid_dir)):
        if value is not None:
            args += [flag, str(value)]
    return args


def torchrun_command(spec: LaunchSpec, run_id: str | None = None) -> str:
    """The equivalent ``torchrun`` command line, for scripts and clusters."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(spec.nproc),
            "--max-restarts", str(spec.max_restarts), "-m", WORKER_MODULE, *worker_args(spec, run_id)]
    return shlex.join(argv)


def describe_failures(failures: dict) -> str:  # noqa: ANN001 - {global rank: ProcessFailure}
    """One line per failed rank, earliest first: pid, then the signal or exit code and the error."""
    parts = []
    for rank, failure in sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0])):
        if failure.exitcode < 0:
            parts.append(f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}")
            continue
        text = f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}"
        if failure.error_file_data:
            text += ": " + str(failure.message).strip().splitlines()[0]
        parts.append(text)
    return "; ".join(parts)


def _config(spec: LaunchSpec, log_dir: str):  # noqa: ANN202 - torch's LaunchConfig
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=spec.nproc, run_id=str(uuid.uuid4()),
                        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=spec.max_restarts,
                        monitor_interval=0.1, logs_specs=DefaultLogsSpecs(log_dir=log_dir), shutdown_timeout=5)


def _worker_env(spec: LaunchSpec) -> None:
    """Workers inherit the launcher's environment: make the packages importable, pin threads."""
    paths = [str(_REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    threads = spec.threads or max(1, (os.cpu_count() or 1) // spec.nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _open_run(spec: LaunchSpec, scenario: Scenario, store: RunStore) -> str:
    if spec.resume is not None:
        return store.get_run(spec.resume).id
    from clients.datasets import build_federation
    from clients.models import build_model, num_params

    fed = build_federation(scenario.data, scenario.federation.clients, scenario.seed)
    size = num_params(build_model(scenario.model.name, fed.input_shape, fed.num_classes, seed=scenario.seed))
    info = run_info(spec.mode, spec.nproc, spec.local_steps, spec.bucket_mb, spec.timeout_s)
    return create_run(store, scenario, spec.mode, size, info)


def launch(spec: LaunchSpec) -> RunSummary:
    """Run the job to the end; returns the run's summary.

    Raises
    ------
    ParallelError
        The job cannot start (bad settings, more workers than clients).
    LaunchFailed
        A worker failed; the message names every failed rank.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    scenario = check_spec(spec)
    store = RunStore(spec.db)
    run_id = _open_run(spec, scenario, store)
    started = time.monotonic()
    _worker_env(spec)
    with tempfile.TemporaryDirectory(prefix="quorum-parallel-") as log_dir:
        try:
            elastic_launch(_config(spec, log_dir), sys.executable)("-u", "-m", WORKER_MODULE,
                                                                  *worker_args(spec, run_id))
        except ChildFailedError as exc:
            message = f"parallel job failed: {describe_failures(exc.failures)}"
            store.set_status(run_id, "failed", error=message)
            store.log(run_id, message, "error")
            raise LaunchFailed(f"{message} (run {run_id})") from None
        except BaseException as exc:
            store.set_status(run_id, "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed",
                             error=f"launcher: {type(exc).__name__}: {exc}")
            raise
    return summarize(store, run_id, time.monotonic() - started)
