"""Benchmark: the synchronous data-parallel mode against PyTorch's DDP (issue #7).

Both trainers run **in the same torchrun job** (gloo, ``--nproc`` processes),
on the same model (the scenario's CNN), the same per-rank shards and the same
batches, with the same optimiser (SGD, lr 0.05):

* **Ours**: :class:`runtimes.parallel.sync.SyncSGD`, i.e. gradients written
  straight into the wire buffer, one bucketed all-reduce of the core's monoid
  state (sums + weight + count), ``core.finalize``, SGD step.
* **DDP** (anchor): ``torch.nn.parallel.DistributedDataParallel`` with its
  defaults (25 MiB buckets, all-reduce overlapped with backward), mean loss.

Timed blocks of ``--steps`` steps alternate (ours, DDP, DDP, ours, ...) so
the noise of a shared machine hits both; each block starts and ends with a
barrier. ``throughput_vs_ddp`` is the median over repeats of the ratio of the
two blocks' samples per second. After the timed steps both models have taken
the same steps on the same data, so their parameters must agree
(``max_param_diff``).

Traffic: one round of each mode over the same scenario (one local epoch,
each rank one client) through the production round code
(``runtimes.parallel.job.run_round``); the figure is the payload each rank
hands to collectives per epoch, model and metrics together.

    python bench/parallel.py            # MNIST 5k, CNN, 2 processes
    python bench/parallel.py --quick    # digits, CNN, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGET = 0.9

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="digits, few steps: seconds (CI)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="steps per timed block")
    p.add_argument("--repeats", type=int, default=None, help="timed blocks per trainer")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.dataset = "digits" if args.quick else "mnist"
    args.steps = args.steps or (10 if args.quick else 60)
    args.repeats = args.repeats or (3 if args.quick else 7)
    return args


# ----------------------------------------------------------------- worker side


def _scenario(args: argparse.Namespace, world: int):
    from scenarios.schema import scenario_from_dict

    return scenario_from_dict({
        "name": "bench-parallel", "seed": 0, "rounds": 1,
        "data": {"dataset": args.dataset, "partition": "iid"}, "model": {"name": "cnn"},
        "federation": {"clients": world}, "training": {"batch_size": args.batch_size, "lr": 0.05},
        "evaluation": {"federated": False, "server": False}})


def _batches(job, args: argparse.Namespace, count: int) -> list[tuple[Any, Any]]:
    import torch

    x, y = job.shard
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(job.comm.rank))
    b = args.batch_size
    starts = [(i * b) % (len(y) - b + 1) for i in range(count)]
    return [(x[order[s:s + b]], y[order[s:s + b]]) for s in starts]


def _ddp_step(ddp, optimizer, xb, yb) -> float:
    from torch.nn import functional as F

    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(ddp(xb), yb)
    loss.backward()
    optimizer.step()
    return float(loss.item())


def _timed(comm, run, batches) -> float:
    comm.barrier()
    started = time.perf_counter()
    for xb, yb in batches:
        run(xb, yb)
    comm.barrier()
    return time.perf_counter() - started


def _throughput(args: argparse.Namespace, comm) -> dict[str, Any]:
    import numpy as np
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from learning.models import build_model, get_flat
    from runtimes.parallel.job import JobSpec, build_job
    from runtimes.parallel.mode import Mode

    job = build_job(JobSpec(_scenario(args, comm.world), Mode.SYNC), comm)
    fed = job.fed
    ddp = DistributedDataParallel(build_model("cnn", fed.input_shape, fed.num_classes, seed=0))
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    ours = job.trainer.step
    theirs = lambda xb, yb: _ddp_step(ddp, ddp_opt, xb, yb)  # noqa: E731
    batches = _batches(job, args, 5 + args.steps * args.repeats)
    warm, timed = batches[:5], batches[5:]
    for run in (ours, theirs):
        _timed(comm, run, warm)
    sent = comm.bytes_sent
    ours_s, ddp_s = [], []
    for rep in range(args.repeats):
        block = timed[rep * args.steps:(rep + 1) * args.steps]
        pair = [(ours_s, ours), (ddp_s, theirs)]
        for times, run in pair if rep % 2 == 0 else pair[::-1]:
            times.append(_timed(comm, run, block))
    samples = comm.world * args.batch_size * args.steps
    diff = float(np.abs(get_flat(job.model) - get_flat(ddp.module)).max())
    return {"ours_s": ours_s, "ddp_s": ddp_s, "samples_per_block": samples, "max_param_diff": diff,
            "ours_bytes_per_step": (comm.bytes_sent - sent) / (args.steps * args.repeats),
            "num_params": int(sum(p.numel() for p in job.model.parameters()))}


def _traffic(args: argparse.Namespace, comm) -> dict[str, Any]:
    from runtimes.parallel.job import JobSpec, build_job, initial_state, run_round
    from runtimes.parallel.mode import Mode

    out = {}
    for mode in (Mode.SYNC, Mode.LOCALSGD):
        job = build_job(JobSpec(_scenario(args, comm.world), mode), comm)
        started = time.perf_counter()
        result = run_round(job, initial_state(job), 1)
        out[mode.value] = {"bytes": result.bytes_sent, "seconds": time.perf_counter() - started,
                           "steps": result.steps}
    return out


def _worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from runtimes.parallel.comm import Comm, release_process_group

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    comm = Comm(rank=dist.get_rank(), world=dist.get_world_size(), timeout_s=120)
    try:
        result = {"throughput": _throughput(args, comm), "traffic": _traffic(args, comm)}
    finally:
        release_process_group()
    if comm.rank == 0:
        args.out.write_text(json.dumps(result))
    return 0


# ----------------------------------------------------------------- launcher side


def _launch(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               str(Path(__file__).resolve()), "--worker", "--out", str(out), "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--repeats", str(args.repeats), *(["--quick"] if args.quick else [])]
        threads = max(1, (os.cpu_count() or 1) // args.nproc)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads), "LOGLEVEL": "ERROR"}
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        return json.loads(out.read_text())


def _figures(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    t, traffic = raw["throughput"], raw["traffic"]
    ratios = [d / o for o, d in zip(t["ours_s"], t["ddp_s"], strict=True)]  # (samples/ours_s) / (samples/ddp_s)
    ours_tp = t["samples_per_block"] / statistics.median(t["ours_s"])
    ddp_tp = t["samples_per_block"] / statistics.median(t["ddp_s"])
    sync_b, local_b = traffic["sync"]["bytes"], traffic["localsgd"]["bytes"]
    return {
        "bench": "parallel", "quick": args.quick, "dataset": args.dataset, "model": "cnn",
        "nproc": args.nproc, "batch_size": args.batch_size, "steps": args.steps, "repeats": args.repeats,
        "num_params": t["num_params"], "ours_samples_per_s": round(ours_tp, 1), "ddp_samples_per_s": round(ddp_tp, 1),
        "throughput_vs_ddp": round(statistics.median(ratios), 4), "throughput_vs_ddp_min": round(min(ratios), 4),
        "throughput_vs_ddp_max": round(max(ratios), 4), "max_param_diff": t["max_param_diff"],
        "sync_bytes_per_step": t["ours_bytes_per_step"], "sync_steps_per_epoch": traffic["sync"]["steps"],
        "sync_bytes_per_epoch": sync_b, "localsgd_bytes_per_epoch": local_b,
        "localsgd_vs_sync_bytes": round(local_b / sync_b, 5), "target_throughput_vs_ddp": TARGET,
        "meets_target": statistics.median(ratios) >= TARGET,
    }


def _table(f: dict[str, Any]) -> str:
    rows = [
        ("sync (ours), samples/s", f"{f['ours_samples_per_s']:,.1f}"),
        ("DDP, samples/s", f"{f['ddp_samples_per_s']:,.1f}"),
        ("ours / DDP (median of pairs)", f"{f['throughput_vs_ddp']:.3f}  "
                                          f"[{f['throughput_vs_ddp_min']:.3f} .. {f['throughput_vs_ddp_max']:.3f}]"),
        ("max |params ours - DDP|", f"{f['max_param_diff']:.2e}"),
        ("sync bytes / rank / epoch", f"{f['sync_bytes_per_epoch']:,} ({f['sync_steps_per_epoch']} steps)"),
        ("local-SGD bytes / rank / epoch", f"{f['localsgd_bytes_per_epoch']:,}"),
        ("local-SGD / sync bytes", f"{f['localsgd_vs_sync_bytes']:.4f}"),
    ]
    width = max(len(k) for k, _ in rows)
    head = (f"parallel bench: {f['dataset']}, cnn ({f['num_params']:,} params), {f['nproc']} gloo processes, "
            f"batch {f['batch_size']}/rank, {f['repeats']} x {f['steps']} steps per trainer")
    return "\n".join([head, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        return _worker(args)
    figures = _figures(args, _launch(args))
    print(_table(figures), flush=True)
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
