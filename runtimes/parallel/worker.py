r"""One data-parallel worker, as ``torchrun`` starts it: ``python -m runtimes.parallel.worker``.

Reads its rank and the rendezvous from the environment torchrun sets, joins
the gloo process group with a timeout on every collective, trains the
scenario's rounds and, on rank 0, commits each round to the run store. Any
failure (including a SIGTERM from torchrun because another worker died) marks
the run failed with the reason before the process exits non-zero.

Multi-node, e.g. under Slurm (every node runs the same line)::

    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \
        -m runtimes.parallel.worker --scenario scenarios/quickstart.toml --db postgresql://...
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from aggregator.evaluation import ServerEvaluator
from core.envvars import env_number
from core.errors import QuorumError
from core.records import RoundRecord
from core.status import RunStatus
from core.strategy import ServerState, would_exceed_budget
from learning.models import num_params
from learning.task import TaskModel, load_task
from runstore.lease import lease_seconds
from runstore.runlog import RunLog
from runstore.store import RunStore, default_db_url
from runtimes.parallel.comm import DEFAULT_BUCKET_BYTES, Comm, release_process_group
from runtimes.parallel.errors import ParallelError, WorkerStopped
from runtimes.parallel.job import Job, JobSpec, adopt, build_job, initial_state, run_round
from runtimes.parallel.mode import CommHook, Mode
from runtimes.parallel.runlog import create_run, open_run_log, round_record, run_info
from scenarios.bounds import MAX_CLIENTS
from scenarios.schema import Scenario, load_scenario

__all__ = ["main", "parse_args", "load_job_scenario"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the worker's command line (``sys.argv[1:]`` when ``argv`` is None)."""
    parser = argparse.ArgumentParser(prog="python -m runtimes.parallel.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", required=True, type=Path, help="scenario TOML file")
    parser.add_argument("--mode", choices=[m.value for m in Mode], default=Mode.SYNC.value)
    parser.add_argument("--local-steps", type=int, default=0, help="local SGD: H steps per round (0: local_epochs)")
    parser.add_argument("--comm-hook", choices=[h.value for h in CommHook], default=CommHook.NONE.value,
                        help="sync: torch's DDP gradient-compression hook (none: the core's all-reduce)")
    parser.add_argument("--rounds", type=int, default=None, help="override the scenario's rounds")
    parser.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    parser.add_argument("--db", default=os.environ.get("QUORUM_DB") or default_db_url(), help="run store URL")
    parser.add_argument("--run-id", default=None, help="commit into (or resume) this run; rank 0 creates one if unset")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a collective gives up")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: cores / workers)")
    parser.add_argument("--run-id-file", type=Path, default=None,
                        help="rank 0 writes the run id here, and resumes the run it names after a restart")
    parser.add_argument("--pid-dir", type=Path, default=None, help="write rankN.pid files here (supervision)")
    return parser.parse_args(argv)


def load_job_scenario(path: Path, rounds: int | None, seed: int | None) -> Scenario:
    """Load the scenario at ``path`` with the command line's overrides (``rounds``, ``seed``) applied."""
    scenario = load_scenario(path)
    overrides = {k: v for k, v in (("rounds", rounds), ("seed", seed)) if v is not None}
    return scenario.with_overrides(**overrides) if overrides else scenario


def _stop(signum: int, _frame: FrameType | None) -> None:
    raise WorkerStopped(f"stopped by {signal.Signals(signum).name}, usually because another worker failed")


def _ranks() -> tuple[int, int, int]:
    """Return this worker's rank, the world size and the workers on this machine, as torchrun sets them.

    Raises
    ------
    ParallelError
        A variable that is not a whole number in its range, naming it (a worker per client at most).
    """
    world = env_number("WORLD_SIZE", 1, 1, MAX_CLIENTS, means="the number of workers", error=ParallelError)
    rank = env_number("RANK", 0, 0, world - 1, means="this worker's rank", error=ParallelError)
    local_world = env_number("LOCAL_WORLD_SIZE", world, 1, world, means="the workers on this machine",
                             error=ParallelError)
    return rank, world, local_world


def _setup(args: argparse.Namespace) -> Comm:
    rank, world, local_world = _ranks()
    lease_seconds()  # QUORUM_LEASE_S: refused here, before the process group, rather than at rank 0's first lease
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world))
    if args.pid_dir is not None:
        args.pid_dir.mkdir(parents=True, exist_ok=True)
        (args.pid_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, _stop)
    if world > 1 or "MASTER_ADDR" in os.environ:
        timeout = timedelta(seconds=args.timeout)
        dist.init_process_group("gloo", store=_attempt_store(rank, world, timeout), rank=rank, world_size=world,
                                timeout=timeout)
    return Comm(rank=rank, world=world, timeout_s=args.timeout, bucket_bytes=int(args.bucket_mb * 2**20))


def _attempt_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """Return the rendezvous store, with keys of their own for each restart of the worker group.

    torchrun keeps its store across elastic restarts; without a per-attempt
    prefix a restarted rank can read the address its dead predecessor
    published and fail to connect.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    port = env_number("MASTER_PORT", None, 1, 65_535, means="the rendezvous port", error=ParallelError)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], port, world,
                          is_master=not agent and rank == 0, timeout=timeout, multi_tenant=not agent)
    return dist.PrefixStore(f"quorum-parallel/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _open_run(args: argparse.Namespace, job: Job) -> tuple[RunLog, ServerState | None]:
    store = RunStore(args.db)
    run_id = args.run_id
    if run_id is None and args.run_id_file is not None and args.run_id_file.exists():
        run_id = args.run_id_file.read_text().strip() or None  # a restarted group resumes the same run
    if run_id is None:
        info = {**run_info(job.spec.mode, job.comm.world, job.spec.local_steps, args.bucket_mb, args.timeout),
                "comm_hook": job.spec.comm_hook.value}
        run_id = create_run(store, job.scenario, job.spec.mode, num_params(job.model), info)
    run, resumed = open_run_log(store, store.get_run(run_id).id)
    if args.run_id_file is not None:
        args.run_id_file.write_text(run.run_id)
    return run, resumed


def _evaluator(job: Job) -> ServerEvaluator | None:
    fed, scenario = job.fed, job.scenario
    if fed.test is None or not scenario.evaluation.server:
        return None
    return ServerEvaluator(lambda: TaskModel.build(load_task(scenario), scenario.seed), fed.test)


def train_rounds(job: Job, writer: RunLog | None, resumed: ServerState | None = None) -> tuple[ServerState, str]:
    """Run the remaining rounds after ``resumed``; rank 0 commits each. Returns the final state and the run status."""
    start = resumed if resumed is not None else initial_state(job)
    state = job.comm.broadcast_state(start if job.comm.rank == 0 else None, start.params.size)
    if state is None:  # rank 0 always sends one
        raise ParallelError("rank 0 broadcast no server state")
    adopt(job, state)
    evaluator = _evaluator(job) if writer is not None else None
    for server_round in range(state.round + 1, job.scenario.rounds + 1):
        if job.spec.mode is Mode.LOCALSGD and would_exceed_budget(job.strategy, state):
            if writer is not None:
                writer.log(f"privacy budget reached before round {server_round}; stopping")
            return state, RunStatus.STOPPED_BUDGET
        started, t0 = time.time(), time.monotonic()
        result = run_round(job, state, server_round)
        state = result.state
        if writer is not None:
            server = evaluator(state.params) if evaluator is not None and _server_due(job, server_round) else None
            record = round_record(job, result, server_round, started, time.monotonic() - t0, server)
            writer.commit(record, state)
            _progress(job, record)
    return state, RunStatus.FINISHED


def _server_due(job: Job, server_round: int) -> bool:
    return server_round % job.scenario.evaluation.every == 0 or server_round == job.scenario.rounds


def _progress(job: Job, record: RoundRecord) -> None:
    acc = record.server_accuracy if record.server_accuracy is not None else record.fed_accuracy
    loss = "n/a" if record.train_loss is None else f"{record.train_loss:.4f}"
    shown = "n/a" if acc is None else f"{acc:.2%}"
    print(f"[quorum parallel] round {record.round}/{job.scenario.rounds} ({job.spec.mode.value}, "
          f"{job.comm.world} workers): train loss {loss}, accuracy {shown}, {record.duration_s:.2f} s",
          file=sys.stderr, flush=True)


def run(args: argparse.Namespace, comm: Comm) -> str:
    """Build the job, train it, and record how it ended (rank 0)."""
    scenario = load_job_scenario(args.scenario, args.rounds, args.seed)
    job = build_job(JobSpec(scenario, Mode(args.mode), args.local_steps, CommHook(args.comm_hook)), comm)
    writer, resumed = _open_run(args, job) if comm.rank == 0 else (None, None)
    try:
        _, status = train_rounds(job, writer, resumed)
    except BaseException as exc:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish recording the failure; torchrun SIGKILLs late
        if writer is not None:
            writer.end(RunStatus.INTERRUPTED if isinstance(exc, KeyboardInterrupt) else RunStatus.FAILED,
                       error=f"{type(exc).__name__}: {exc}", log_error=True)
        raise
    if writer is not None:
        writer.end(status)
    comm.where = "shutdown"
    comm.barrier()  # every rank tears down together, after rank 0 has recorded the end
    return status


@record
def main(argv: list[str] | None = None) -> int:
    """Run one worker; an expected failure is one line on stderr and in torchrun's error file."""
    args = parse_args(argv)
    try:
        comm = _setup(args)
    except QuorumError as exc:  # the environment it was started with (QUORUM_LEASE_S, torchrun's): before any round
        get_error_handler().record_exception(exc)
        print(f"[quorum parallel] worker cannot start: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        run(args, comm)
    except ParallelError as exc:
        get_error_handler().record_exception(exc)  # what the launcher reports for this rank
        print(f"[quorum parallel] rank {comm.rank} failed: {exc}", file=sys.stderr, flush=True)
        return 1  # no teardown of the process group: a peer is gone, and exiting closes it
    release_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without finalizing the interpreter, whichever way the job ended. A failed job keeps its
    # process group (a peer is gone, so tearing it down could wait on collectives that never finish)
    # and gloo's threads with it, none of which may abort the exit (see comm.release_process_group).
    # A finished one has committed its run and released its group, and tearing down the modules it
    # loaded (torch and its compiler stack) only delays the launcher: about a second per worker on an
    # idle machine, 5-10 s on a loaded one, before the job counts as done.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
