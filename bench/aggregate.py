"""Benchmark: FedAvg aggregation of client updates, ours against Flower 1.42 (issue #2).

Both sides aggregate the same replies, laid out as a Flower reply is: a
``RecordDict`` holding an ``ArrayRecord`` (the update as one flat float32
``Array``) and a ``MetricRecord`` with ``num-examples``. Making them is never
timed.

* **Flower** (the anchor): ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords``,
  the faster of Flower's two FedAvg aggregations, given every reply at once as
  its strategy receives them. Timed: the whole call.
* **Ours**: replies folded one at a time, as they arrive, through the
  production path (``messages.parse_train_reply`` then ``FedAvg.accumulate``,
  i.e. ``core.add``), then ``finalize`` and ``encode_flat`` into an
  ``ArrayRecord`` like Flower's result. Timed: parse, decode, validation,
  fold, finalize and encode.

Every measurement runs in a subprocess of its own (``--worker``):

* **time** (one worker): builds the replies once and alternates Flower and
  ours pass by pass, ``--repeat`` times each, on the same inputs, so that both
  see the same load on a shared machine; best wall (``perf_counter``) and best
  CPU (``process_time``) time of each side. It also checks that the two means
  agree within 1e-5 (max abs difference over max abs value).
* **memory** (one worker per side and client count): Flower holds every
  reply; ours gets each reply from a generator just in time and drops it after
  folding, so one reply is alive at a time. The headline peak is from
  ``tracemalloc`` (numpy reports its buffers to it, the replies' ``bytes`` go
  through Python's allocator), counted from just before the inputs are made:
  Flower's includes every reply it holds, ours the state plus one reply,
  *including the making of that reply* (a stand-in for receiving it). The RSS
  high-water mark above the RSS at the start is a cross-check
  (``/proc/self/clear_refs`` resets it on Linux, ``ru_maxrss`` elsewhere); at
  ``--quick`` sizes RSS is mostly allocator noise.

The run prints a table and ends with one JSON line; the exit status is 1 when
the two means disagree.

    python bench/aggregate.py            # 100 clients x 10M float32 parameters
    python bench/aggregate.py --quick    # 10 clients x 100k, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[1]
WEIGHT_KEY = "num-examples"
TOLERANCE = 1e-5
TARGET_SPEEDUP = 3.0
MB = 1024 * 1024
SIDES = ("flower", "ours")


# ---------------------------------------------------------------- inputs


def base_vector(size: int, seed: int) -> np.ndarray:
    """The vector every client's update is derived from (made before measuring)."""
    return np.random.default_rng(seed).standard_normal(size, dtype=np.float32)


def make_replies(base: np.ndarray, clients: int, seed: int) -> Iterator[Any]:
    """Yield ``clients`` train replies, each made only when asked for.

    Client ``i`` sends ``roll(base, shift_i) * scale_i`` (distinct contents
    for every client at a fraction of the cost of drawing each afresh) and a
    random example count; the same seed gives the same replies in every worker.
    """
    for i in range(clients):
        # no local names the reply: once the caller drops it, nothing here keeps it alive
        yield _reply(base, np.random.default_rng([seed, i]))


def _reply(base: np.ndarray, rng: np.random.Generator) -> Any:
    from core.replies import train_reply

    update = np.roll(base, int(rng.integers(base.shape[0])))
    update *= np.float32(rng.uniform(0.5, 1.5))
    return train_reply(update, int(rng.integers(16, 1024)), {})


# ---------------------------------------------------------------- the two sides


def clocks() -> np.ndarray:
    """Wall and process CPU time now, in seconds."""
    return np.array([time.perf_counter(), time.process_time()])


def flower_aggregate(replies: list[Any], size: int) -> tuple[Any, np.ndarray]:  # noqa: ARG001 (ours_aggregate's)
    """Flower's FedAvg aggregation over all replies; returns (ArrayRecord, [wall, cpu] seconds)."""
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    start = clocks()
    record = aggregate_arrayrecords(replies, WEIGHT_KEY)
    return record, clocks() - start


def ours_aggregate(replies: Iterable[Any], size: int) -> tuple[Any, np.ndarray]:
    """Our fold, one reply at a time; returns (ArrayRecord, [wall, cpu] seconds spent in it)."""
    from flwr.app import ArrayRecord

    from aggregator.strategies.fedavg import FedAvg
    from core.replies import encode_flat, parse_train_reply

    strategy, max_bytes = FedAvg(), size * 4 + 4096
    start = clocks()
    state = strategy.new_aggregate(size)
    elapsed = clocks() - start
    for content in replies:  # making a reply (generator) is not timed
        start = clocks()
        parsed = parse_train_reply(content, size, max_bytes)
        state = strategy.accumulate(state, parsed.delta, parsed.num_examples)
        elapsed += clocks() - start
        del content, parsed  # drop the reply before the next one is made
    start = clocks()
    mean = strategy.finalize(state, np.random.default_rng(0))
    record = ArrayRecord({"delta": encode_flat(mean)})
    return record, elapsed + clocks() - start


def max_rel_err(ours: np.ndarray, flower: np.ndarray) -> float:
    """max |ours - flower| / max |flower|: a relative error that near-zero entries cannot blow up."""
    if ours.shape != flower.shape:
        return math.inf
    return float(np.max(np.abs(ours - flower)) / max(float(np.max(np.abs(flower))), 1e-30))


# ---------------------------------------------------------------- workers


def time_worker(clients: int, size: int, seed: int, repeat: int) -> dict[str, Any]:
    """Alternate Flower and ours on the same replies; best times and the agreement of the means."""
    replies = list(make_replies(base_vector(size, seed), clients, seed))
    flower_aggregate(replies[:1], size), ours_aggregate(replies[:1], size)  # imports and first calls
    best = {side: np.full(2, math.inf) for side in SIDES}
    means: dict[str, np.ndarray] = {}
    for _ in range(repeat):
        for side, run in (("flower", flower_aggregate), ("ours", ours_aggregate)):
            record, seconds = run(replies, size)
            best[side] = np.minimum(best[side], seconds)
            means[side] = record["delta"].numpy()
            del record
    return {"clients": clients, "params": size, "max_rel_err": max_rel_err(means["ours"], means["flower"]),
            **{f"{side}_{clock}": float(best[side][i]) for side in SIDES for i, clock in enumerate(("s", "cpu_s"))}}


def traced(fn: Callable[[], Any]) -> int:
    """Run ``fn`` under tracemalloc and return the peak of traced bytes."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def memory_worker(side: str, clients: int, size: int, seed: int) -> dict[str, Any]:
    """Peak memory of one side at one client count (tracemalloc and RSS)."""
    for content in make_replies(base_vector(1024, seed), 2, seed):  # warm up imports and first calls
        flower_aggregate([content], 1024)
        ours_aggregate([content], 1024)
    base = base_vector(size, seed)  # input-making state, outside both peaks
    rss_start = reset_rss_peak()
    if side == "flower":
        peak = traced(lambda: flower_aggregate(list(make_replies(base, clients, seed)), size))
    else:
        peak = traced(lambda: ours_aggregate(make_replies(base, clients, seed), size))
    return {"side": side, "clients": clients, "params": size, "peak_bytes": peak,
            "rss_peak_bytes": max(rss_peak() - rss_start, 0)}


def reset_rss_peak() -> int:
    """Reset the RSS high-water mark where the OS allows it; return RSS now (bytes)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return rss_peak()


def rss_peak() -> int:
    """RSS high-water mark of this process in bytes (ru_maxrss is KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# ---------------------------------------------------------------- parent


def run_worker(args: argparse.Namespace, kind: str, clients: int) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter and return its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--clients", str(clients),
           "--params", str(args.params), "--seed", str(args.seed), "--repeat", str(args.repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"worker {kind} x {clients} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def collect(args: argparse.Namespace) -> tuple[dict[str, Any], dict[tuple[str, int], dict[str, Any]]]:
    """The timing result and the peaks keyed (side, clients)."""
    timing = run_worker(args, "time", args.clients)
    peaks = {(side, n): run_worker(args, side, n)
             for n in sorted({args.clients, *args.scaling}) for side in SIDES}
    return timing, peaks


def summary(args: argparse.Namespace, timing: dict[str, Any],
            peaks: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """The figures and ratios of the final JSON line."""
    ours, flower = peaks["ours", args.clients], peaks["flower", args.clients]
    low, high = (peaks["ours", n]["peak_bytes"] for n in (min(args.scaling), max(args.scaling)))
    speedup = timing["flower_s"] / timing["ours_s"]
    return {
        "benchmark": "aggregate", "clients": args.clients, "params": args.params, "repeat": args.repeat,
        "memory_method": "tracemalloc", **{k: v for k, v in timing.items() if k.endswith("_s")},
        "speedup_vs_flower": speedup, "speedup_vs_flower_cpu": timing["flower_cpu_s"] / timing["ours_cpu_s"],
        "ours_peak_mb": ours["peak_bytes"] / MB, "flower_peak_mb": flower["peak_bytes"] / MB,
        "peak_memory_ratio": ours["peak_bytes"] / flower["peak_bytes"],
        "ours_rss_peak_mb": ours["rss_peak_bytes"] / MB, "flower_rss_peak_mb": flower["rss_peak_bytes"] / MB,
        "peak_rss_ratio": ours["rss_peak_bytes"] / max(flower["rss_peak_bytes"], 1),
        f"ours_peak_mb_{min(args.scaling)}_clients": low / MB, f"ours_peak_mb_{max(args.scaling)}_clients": high / MB,
        "ours_peak_growth": high / low, "max_rel_err": timing["max_rel_err"],
        "results_match": timing["max_rel_err"] <= TOLERANCE, "target_speedup": TARGET_SPEEDUP,
        "meets_target": speedup >= TARGET_SPEEDUP and high <= 1.05 * low,
    }


def print_table(args: argparse.Namespace, timing: dict[str, Any], peaks: dict[tuple[str, int], dict[str, Any]],
                figures: dict[str, Any]) -> None:
    """A readable table of every measurement, then the headline ratios."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"FedAvg aggregation, {args.params:,} float32 parameters",
                  caption=f"wall / CPU: best of {args.repeat}; peak MB: tracemalloc; RSS MB: high-water above start")
    for column in ("side", "clients", "wall s", "CPU s", "peak MB", "RSS MB"):
        table.add_column(column, justify="left" if column == "side" else "right")
    for (side, clients), r in sorted(peaks.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        times = [f"{timing[f'{side}_{clock}']:.3f}" if clients == args.clients else "-" for clock in ("s", "cpu_s")]
        table.add_row("ours" if side == "ours" else "Flower", str(clients), *times,
                      f"{r['peak_bytes'] / MB:,.1f}", f"{r['rss_peak_bytes'] / MB:,.1f}")
    console = Console()
    console.print(table)
    console.print(f"speedup vs Flower: {figures['speedup_vs_flower']:.2f}x wall, "
                  f"{figures['speedup_vs_flower_cpu']:.2f}x CPU (target {TARGET_SPEEDUP:g}x)")
    console.print(f"peak memory ours / Flower: {figures['peak_memory_ratio']:.4f}; our peak from "
                  f"{min(args.scaling)} to {max(args.scaling)} clients: x{figures['ours_peak_growth']:.3f}")
    console.print(f"ours vs Flower's mean: max rel err {figures['max_rel_err']:.2e} (tolerance {TOLERANCE:g})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=None, help="clients in the comparison (default 100)")
    parser.add_argument("--params", type=int, default=None, help="float32 parameters per update (default 10M)")
    parser.add_argument("--scaling", type=int, nargs=2, default=[10, 100], help="client counts for peak growth")
    parser.add_argument("--repeat", type=int, default=5, help="alternating timed passes per side (best kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="10 clients x 100k parameters")
    parser.add_argument("--worker", choices=("time", *SIDES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    default = (10, 100_000) if args.quick else (100, 10_000_000)
    args.clients = args.clients or default[0]
    args.params = args.params or default[1]
    if min(args.clients, args.params, args.repeat, *args.scaling) <= 0:
        parser.error("--clients, --params, --repeat and --scaling must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(REPO))
        result = (time_worker(args.clients, args.params, args.seed, args.repeat) if args.worker == "time"
                  else memory_worker(args.worker, args.clients, args.params, args.seed))
        print(json.dumps(result))
        return 0
    timing, peaks = collect(args)
    figures = summary(args, timing, peaks)
    print_table(args, timing, peaks, figures)
    print(json.dumps(figures), flush=True)
    return 0 if figures["results_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
