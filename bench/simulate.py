"""Benchmark: the in-process runtime at scale, one process and the worker pool, against Flower's Ray (issue #18).

``scenarios/scale-10k.toml`` (MNIST 5k resampled into virtual clients of 40
examples, 100 sampled per round, logistic regression, FedAvg) runs at 100,
1,000 and 10,000 clients on three runtimes, each in a process of its own:

- ``single``: the in-process runtime with one worker (every client in the aggregator's process);
- ``pool``: the in-process runtime with its pool (one forked worker per core);
- ``ray``: Flower's simulation engine (Ray) running the same ServerApp and ClientApp.

For each it reports start-up (from the process's launch to the start of the
first round's work), time per round (the median of the rounds after the
first, so that a burst of load from elsewhere on a shared machine moves it
less; the mean is printed beside it), and the peak memory of the whole process tree (the aggregator, every
worker, Ray's actors and daemons), sampled every 0.2 s: the sum of every
process's proportional set size (``Pss`` in ``/proc/PID/smaps_rollup``, so
pages that forked workers share count once), with the RSS sum beside it. The
final models are compared with the single process's.

    python bench/simulate.py                 # 100 / 1,000 / 10,000 clients, 6 rounds each (minutes)
    python bench/simulate.py --quick         # 30 clients, 2 rounds, no Ray (seconds)

Ray runs at the sizes it finishes within ``--ray-limit-s``. Ends with one JSON line.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

__all__ = ["main", "tree_memory_mb", "run_sampled", "Sampled"]

RUNTIMES = ("single", "pool", "ray")
SAMPLE_S = 0.2


# ------------------------------------------------------------------ memory of a process tree


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(_children(pid))
    return pids


def tree_memory_mb(root: int) -> tuple[float, float]:
    """(sum of PSS, sum of RSS) in MB over ``root`` and every process below it."""
    pss = rss = 0
    for pid in _tree(root):
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue  # gone, or not ours to read
        for line in text.splitlines():
            if line.startswith("Pss:"):
                pss += int(line.split()[1])
            elif line.startswith("Rss:"):
                rss += int(line.split()[1])
    return pss / 1024, rss / 1024


# ------------------------------------------------------------------ one run, in a child process


def _scenario(clients: int, rounds: int, quick: bool) -> Any:
    from scenarios.schema import load_scenario

    raw = load_scenario(REPO / "scenarios" / "scale-10k.toml").to_dict()
    raw["rounds"] = rounds
    raw["federation"] = {**raw["federation"], "clients": clients,
                         "clients_per_round": min(raw["federation"]["clients_per_round"], clients),
                         "min_clients": 1}
    if quick:
        raw["federation"]["clients_per_round"] = min(10, clients)
    from scenarios.schema import scenario_from_dict

    return scenario_from_dict(raw, source="bench/simulate.py")


def child(runtime: str, clients: int, rounds: int, quick: bool, out: Path) -> None:
    """Run one cell and write its round end times and final model to ``out``."""
    import numpy as np

    from runstore.store import RunStore
    from runtimes.simulation import simulate

    ends: list[float] = []
    db = f"sqlite:///{out.with_suffix('.db')}"
    engine, workers = ("ray", None) if runtime == "ray" else ("inprocess", 1 if runtime == "single" else None)
    summary = simulate(_scenario(clients, rounds, quick), db_url=db, engine=engine, workers=workers,
                       on_round=lambda _record: ends.append(time.time()))
    state = RunStore(db).load_state(summary.run_id)
    np.save(out.with_suffix(".npy"), state.params)
    out.write_text(json.dumps({"ends": ends, "status": summary.status, "accuracy": summary.final_accuracy}))


@dataclass(frozen=True)
class Sampled:
    """A benchmark cell's process, run to its end: its peak memory, or why it has no figures (``error``)."""

    launched: float
    peak_pss_mb: float
    peak_rss_mb: float
    error: str | None = None


def run_sampled(cmd: list[str], limit_s: float, out: Path) -> Sampled:
    """Run ``cmd`` (a cell that writes ``out``), sampling its process tree's memory until it ends.

    Killed, with its whole tree, after ``limit_s``; an exit that is not 0, or
    no ``out``, is an error naming stderr's last line.
    """
    launched = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    peak_pss = peak_rss = 0.0
    while proc.poll() is None:
        if time.time() - launched > limit_s:
            _kill_tree(proc.pid)
            return Sampled(launched, peak_pss, peak_rss, f"over the {limit_s:g} s limit")
        pss, rss = tree_memory_mb(proc.pid)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(SAMPLE_S)
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stderr.read() if proc.stderr else "").strip().splitlines()[-1:]
        return Sampled(launched, peak_pss, peak_rss, f"exit {proc.returncode}: {' '.join(tail)}")
    return Sampled(launched, peak_pss, peak_rss)


def measure(runtime: str, clients: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Launch one cell, sample its process tree's memory until it ends; its figures, or why it has none."""
    out = work / f"{runtime}-{clients}.json"
    cmd = [sys.executable, __file__, "--child", runtime, str(clients), str(args.rounds), str(out)]
    if args.quick:
        cmd.append("--quick")
    sampled = run_sampled(cmd, args.ray_limit_s if runtime == "ray" else args.limit_s, out)
    if sampled.error is not None:
        return {"runtime": runtime, "clients": clients, "error": sampled.error}
    launched, peak_pss, peak_rss = sampled.launched, sampled.peak_pss_mb, sampled.peak_rss_mb
    done = json.loads(out.read_text())
    ends = done["ends"]
    durations = [b - a for a, b in zip(ends, ends[1:], strict=False)] or [ends[0] - launched]
    per_round, mean = statistics.median(durations), statistics.fmean(durations)
    return {"runtime": runtime, "clients": clients, "status": done["status"], "accuracy": done["accuracy"],
            "startup_s": round(ends[0] - launched - per_round, 2), "round_s": round(per_round, 3),
            "round_s_mean": round(mean, 3),
            "peak_pss_mb": round(peak_pss, 1), "peak_rss_mb": round(peak_rss, 1),
            "model": str(out.with_suffix(".npy"))}


def _kill_tree(pid: int) -> None:
    import contextlib
    import signal

    for member in reversed(_tree(pid)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


# ------------------------------------------------------------------ the table and the figures


def agreement(cells: list[dict[str, Any]]) -> None:
    """Each cell's largest difference from the single process's final model at its size."""
    import numpy as np

    base = {c["clients"]: np.load(c["model"]) for c in cells if c["runtime"] == "single" and "model" in c}
    for cell in cells:
        if "model" in cell and cell["clients"] in base:
            cell["max_abs_diff"] = float(np.max(np.abs(np.load(cell["model"]) - base[cell["clients"]])))


def summarize(cells: list[dict[str, Any]], middle: int) -> dict[str, Any]:
    def at(runtime: str, clients: int, key: str) -> float | None:
        for cell in cells:
            if cell["runtime"] == runtime and cell["clients"] == clients and key in cell:
                return float(cell[key])
        return None

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 2)

    sizes = sorted({c["clients"] for c in cells})
    diffs = [c["max_abs_diff"] for c in cells if "max_abs_diff" in c]
    return {
        "speedup_vs_ray": ratio(at("ray", middle, "round_s"), at("pool", middle, "round_s")),
        "memory_vs_ray": ratio(at("pool", middle, "peak_pss_mb"), at("ray", middle, "peak_pss_mb")),
        "pool_vs_single": ratio(at("single", middle, "round_s"), at("pool", middle, "round_s")),
        f"peak_pss_mb_{sizes[0]}": at("pool", sizes[0], "peak_pss_mb"),
        f"peak_pss_mb_{sizes[-1]}": at("pool", sizes[-1], "peak_pss_mb"),
        "pss_growth": ratio(at("pool", sizes[-1], "peak_pss_mb"), at("pool", sizes[0], "peak_pss_mb")),
        "models_match": bool(diffs) and max(diffs) <= 1e-5,
        "max_abs_diff": max(diffs, default=None),
    }


def table(cells: list[dict[str, Any]]) -> str:
    rows = ["| runtime | clients | start-up s | s / round | peak PSS MB | peak RSS MB | accuracy | max abs diff |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in cells:
        if "error" in c:
            rows.append(f"| {c['runtime']} | {c['clients']:,} | {c['error']} | | | | | |")
            continue
        diff = c.get("max_abs_diff")
        rows.append(f"| {c['runtime']} | {c['clients']:,} | {c['startup_s']:.1f} | {c['round_s']:.2f} | "
                    f"{c['peak_pss_mb']:.0f} | {c['peak_rss_mb']:.0f} | {c['accuracy']:.3f} | "
                    f"{'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 clients, 2 rounds, no Ray")
    parser.add_argument("--sizes", type=int, nargs="+", help="federation sizes (default 100 1000 10000)")
    parser.add_argument("--rounds", type=int, help="rounds per run (default 6; --quick 2)")
    parser.add_argument("--runtimes", nargs="+", choices=RUNTIMES, help="default: all (--quick: single pool)")
    parser.add_argument("--limit-s", type=float, default=1200.0, help="give up an in-process cell after this")
    parser.add_argument("--ray-limit-s", type=float, default=600.0, help="give up a Ray cell after this")
    parser.add_argument("--child", nargs=4, metavar=("RUNTIME", "CLIENTS", "ROUNDS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes = args.sizes or ([30] if args.quick else [100, 1000, 10000])
    args.rounds = args.rounds or (2 if args.quick else 6)
    args.runtimes = args.runtimes or (["single", "pool"] if args.quick else list(RUNTIMES))
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (time per round is measured after the first)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        runtime, clients, rounds, out = args.child
        child(runtime, int(clients), int(rounds), args.quick, Path(out))
        return 0
    with tempfile.TemporaryDirectory(prefix="quorum-bench-simulate-") as work:
        cells = []
        for clients in args.sizes:
            for runtime in args.runtimes:
                cell = measure(runtime, clients, args, Path(work))
                print(json.dumps({k: v for k, v in cell.items() if k != "model"}), file=sys.stderr, flush=True)
                cells.append(cell)
        agreement(cells)
        middle = args.sizes[len(args.sizes) // 2]
        print(table(cells))
        print(json.dumps({**summarize(cells, middle), "sizes": args.sizes, "rounds": args.rounds,
                          "cores": len(os.sched_getaffinity(0)), "quick": args.quick}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
