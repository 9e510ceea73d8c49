"""Launch a data-parallel job on this machine: torchrun's elastic agent, run in-process.

:func:`launch` is what ``quorum parallel`` calls. It checks the scenario,
then starts ``nproc`` workers with torchrun's own machinery
(``torch.distributed.launcher.elastic_launch``: a c10d rendezvous on a free
local port, as ``torchrun --standalone`` does) and waits. When a worker dies
the agent stops the others (or restarts the whole group, up to
``max_restarts`` times, and the workers resume from the last committed
round); the failure comes back as one :class:`LaunchFailed` naming each failed
rank, its pid and its exit code or signal, and the run (rank 0 tells the
launcher its id through a file) is marked failed with that message.
:func:`torchrun_command` gives the equivalent command line.
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
from typing import TYPE_CHECKING

from core.status import RunStatus
from runstore.store import RunStore, default_db_url
from runtimes.parallel.errors import LaunchFailed, ParallelError
from runtimes.parallel.job import check_scenario
from runtimes.parallel.mode import CommHook, Mode
from runtimes.parallel.worker import load_job_scenario
from runtimes.simulation import RunSummary, summarize
from scenarios.bounds import MAX_WAIT_S
from scenarios.schema import Scenario

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.launcher.api import LaunchConfig

__all__ = ["LaunchSpec", "check_spec", "worker_args", "torchrun_command", "launch", "describe_failures"]

WORKER_MODULE = "runtimes.parallel.worker"
#: The largest DDP gradient bucket, in MiB (torch allocates each bucket whole).
MAX_BUCKET_MB = 4096.0
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class LaunchSpec:
    """A data-parallel job on this machine (see ``quorum parallel --help``)."""

    scenario: Path
    nproc: int = 2
    mode: Mode = Mode.SYNC
    local_steps: int = 0
    comm_hook: CommHook = CommHook.NONE
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
    checks = (("nproc", spec.nproc, spec.nproc >= 1), ("local_steps", spec.local_steps, spec.local_steps >= 0),
              ("timeout", spec.timeout_s, 0 < spec.timeout_s <= MAX_WAIT_S),  # timedelta overflows past that
              ("bucket_mb", spec.bucket_mb, 0 < spec.bucket_mb <= MAX_BUCKET_MB),
              ("max_restarts", spec.max_restarts, spec.max_restarts >= 0), ("threads", spec.threads, spec.threads >= 0))
    for key, value, ok in checks:
        if not ok:
            raise ParallelError(f"{key} = {value!r}: out of range (timeout: seconds in (0, {MAX_WAIT_S:,.0f}]; "
                                f"bucket_mb: (0, {MAX_BUCKET_MB:,.0f}]; counts: >= 0, nproc >= 1)")
    if spec.local_steps and spec.mode is not Mode.LOCALSGD:
        raise ParallelError(f"local_steps = {spec.local_steps}: only the localsgd mode takes local steps")
    if spec.comm_hook is CommHook.BF16:
        raise ParallelError("comm_hook = 'bf16': torch's bf16_compress_hook runs on NCCL (GPUs) only, and this "
                            "mode runs on gloo; use fp16 or powersgd")
    if spec.comm_hook is not CommHook.NONE and spec.mode is not Mode.SYNC:
        raise ParallelError(f"comm_hook = {spec.comm_hook.value!r}: torch's DDP hooks compress the sync mode's "
                            "gradients; the localsgd mode compresses client updates with [compression]")
    scenario = load_job_scenario(spec.scenario, spec.rounds, spec.seed)
    check_scenario(scenario, spec.mode, spec.nproc)
    return scenario


def worker_args(spec: LaunchSpec, run_id: str | None, run_id_file: Path | None = None) -> list[str]:
    """Return the worker's command-line arguments for ``spec``."""
    args = ["--scenario", str(spec.scenario), "--mode", spec.mode.value, "--local-steps", str(spec.local_steps),
            "--comm-hook", spec.comm_hook.value,
            "--db", spec.db, "--timeout", f"{spec.timeout_s:g}", "--bucket-mb", f"{spec.bucket_mb:g}",
            "--threads", str(spec.threads)]
    for flag, value in (("--rounds", spec.rounds), ("--seed", spec.seed), ("--run-id", run_id),
                        ("--run-id-file", run_id_file), ("--pid-dir", spec.pid_dir)):
        if value is not None:
            args += [flag, str(value)]
    return args


def torchrun_command(spec: LaunchSpec, run_id: str | None = None) -> str:
    """Return the equivalent ``torchrun`` command line, for scripts and clusters."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(spec.nproc),
            "--max-restarts", str(spec.max_restarts), "-m", WORKER_MODULE, *worker_args(spec, run_id)]
    return shlex.join(argv)


def describe_failures(failures: dict[int, ProcessFailure]) -> str:
    """One clause per failed rank, likely root causes first: pid, then the signal or exit code and the error.

    A rank killed by a signal other than SIGTERM comes first, then ranks
    that exited with an error, then ranks killed by SIGTERM (the launcher's
    own stop signal); within each, by time of failure.
    """
    parts = []
    for rank, failure in sorted(failures.items(), key=_cause_order):
        if failure.exitcode < 0:
            parts.append(f"rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}")
            continue
        text = f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}"
        # A worker's error file holds {"message": "Type: text", ...}; without one torch puts advice here.
        message = str(failure.message.get("message", "")) if isinstance(failure.message, dict) else ""
        parts.append(f"{text}: {message.strip().splitlines()[0]}" if message.strip() else text)
    return "; ".join(parts)


def _cause_order(item: tuple[int, ProcessFailure]) -> tuple[int, int, int]:
    """Killed by a signal first, then errors, then ranks the launcher itself stopped (SIGTERM)."""
    rank, failure = item
    kind = (2 if failure.signal_name() == "SIGTERM" else 0) if failure.exitcode < 0 else 1
    return kind, failure.timestamp, rank


def _config(spec: LaunchSpec, log_dir: str) -> LaunchConfig:
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


def _run_id(spec: LaunchSpec, id_file: Path) -> str | None:
    """Return the run the workers wrote into: the resumed one, or the one rank 0 created (None if none)."""
    if spec.resume is not None:
        return spec.resume
    text = id_file.read_text().strip() if id_file.exists() else ""
    return text or None


def _check_resumable(store: RunStore, spec: LaunchSpec, run_id: str) -> None:
    """Only a parallel run of the same mode can be continued (the checkpoint's slots differ by mode)."""
    run = store.get_run(run_id)  # RunNotFound names the run and the store
    mode = (run.info or {}).get("mode")
    if run.engine != "parallel" or mode != spec.mode.value:
        raise ParallelError(f"run {run.id} is a {run.engine} run (mode {mode}); --resume continues a "
                            f"parallel run of the same mode, here {spec.mode.value}")
    hook = (run.info or {}).get("comm_hook", CommHook.NONE.value)
    if hook != spec.comm_hook.value:
        raise ParallelError(f"run {run.id} trained with --comm-hook {hook}; resume it with the same hook, "
                            f"not {spec.comm_hook.value} (its rounds would mix two methods under one label)")


def _mark_failed(store: RunStore, run_id: str | None, status: str, message: str) -> None:
    if run_id is None:
        return
    store.set_status(run_id, status, error=message)
    store.log(run_id, message, "error")


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

    check_spec(spec)
    store = RunStore(spec.db)
    if spec.resume is not None:
        _check_resumable(store, spec, spec.resume)
    started = time.monotonic()
    _worker_env(spec)
    with tempfile.TemporaryDirectory(prefix="quorum-parallel-") as tmp:
        id_file = Path(tmp) / "run-id"
        args = worker_args(spec, spec.resume, id_file if spec.resume is None else None)
        try:
            elastic_launch(_config(spec, tmp), sys.executable)("-u", "-m", WORKER_MODULE, *args)
        except ChildFailedError as exc:
            run_id = _run_id(spec, id_file)
            message = f"parallel job failed: {describe_failures(exc.failures)}"
            _mark_failed(store, run_id, RunStatus.FAILED, message)
            raise LaunchFailed(message + (f" (run {run_id})" if run_id else "")) from None
        except BaseException as exc:
            status = RunStatus.INTERRUPTED if isinstance(exc, KeyboardInterrupt) else RunStatus.FAILED
            _mark_failed(store, _run_id(spec, id_file), status, f"launcher: {type(exc).__name__}: {exc}")
            raise
        run_id = _run_id(spec, id_file)
    if run_id is None:
        raise ParallelError("the workers finished without opening a run in the store")
    return summarize(store, store.get_run(run_id).id, time.monotonic() - started)
