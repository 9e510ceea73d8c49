"""Benchmark: edge aggregators against a flat federation of the same devices (issue #49).

``scenarios/hierarchy-10k.toml`` (10,000 devices, every one training every
round, logistic regression on resampled MNIST) runs three ways, each in a
process of its own, on the in-process runtime's worker pool:

- ``flat``: ``[hierarchy] edges = 0``, every device answering the aggregator;
- ``tree``: 100 edge aggregators of 100 devices, each answering with one partial sum;
- ``tree-10x``: ten times the devices under ten times the edges (100,000 under 1,000), for memory.

For each it reports, per round, what the aggregator itself received: the
bytes (``rounds.bytes_in``, measured as Flower's wire serialises each
message) and the messages (the devices' replies, or the edges'); the time per
round (the median of the rounds after the first); and the peak memory of the
whole process tree (the sum of every process's PSS, sampled every 0.2 s, as
``bench/simulate.py`` measures it). The flat and the tree run's final models
are compared value by value.

    python bench/hierarchy.py            # 10,000 flat / through 100 edges, 100,000 through 1,000 (about 15 min)
    python bench/hierarchy.py --quick    # 200 flat / through 10 edges, 2,000 through 100 (about 30 s)

Ends with one JSON line: ``top_bytes_ratio`` and ``top_messages_ratio`` (flat
over tree: how many times less reaches the aggregator), ``round_time_ratio``
(tree over flat), ``models_match`` (within 1e-6) and ``pss_100k_over_10k``
(the ten-times tree's peak PSS over the tree's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.simulate import run_sampled  # noqa: E402

__all__ = ["main"]

SCENARIO = REPO / "scenarios" / "hierarchy-10k.toml"


def _scenario(devices: int, edges: int, rounds: int) -> Any:
    from scenarios.schema import load_scenario

    base = load_scenario(SCENARIO)
    raw = base.to_dict()
    raw["federation"] = {**raw["federation"], "clients": devices, "min_clients": 1}
    raw["hierarchy"] = {"edges": edges}
    raw["rounds"] = rounds
    from scenarios.schema import scenario_from_dict

    return scenario_from_dict(raw, source=str(SCENARIO))


def child(devices: int, edges: int, rounds: int, out: Path) -> None:
    """Run one cell and write its rounds' figures and its final model next to ``out``."""
    import numpy as np

    from runstore.store import RunStore
    from runtimes.simulation import simulate

    db = f"sqlite:///{out.with_suffix('.db')}"
    summary = simulate(_scenario(devices, edges, rounds), db_url=db)
    store = RunStore(db)
    rounds_out = []
    for r in store.rounds(summary.run_id):
        tree = (r.tree or {}).get("edges")
        messages = sum(1 for e in tree if "bytes_up" in e) if tree else r.answered + r.rejected + r.failed
        rounds_out.append({"round": r.round, "seconds": r.duration_s, "bytes_in": r.bytes_in, "messages": messages,
                           "answered": r.answered})
    state = store.load_state(summary.run_id)
    assert state is not None
    np.save(out.with_suffix(".npy"), state.params)
    out.write_text(json.dumps({"status": summary.status, "rounds": rounds_out,
                               "accuracy": summary.final_accuracy}))


def measure(name: str, devices: int, edges: int, rounds: int, limit_s: float, work: Path) -> dict[str, Any]:
    """Launch one cell, sample its process tree's memory until it ends; its figures, or why it has none."""
    out = work / f"{name}.json"
    cmd = [sys.executable, __file__, "--child", str(devices), str(edges), str(rounds), str(out)]
    sampled = run_sampled(cmd, limit_s, out)
    if sampled.error is not None:
        return {"cell": name, "devices": devices, "edges": edges, "error": sampled.error}
    done = json.loads(out.read_text())
    per_round = done["rounds"]
    later = per_round[1:] or per_round
    return {"cell": name, "devices": devices, "edges": edges, "status": done["status"],
            "accuracy": done["accuracy"], "answered": statistics.median(r["answered"] for r in later),
            "round_s": round(statistics.median(r["seconds"] for r in later), 3),
            "bytes_in": statistics.median(r["bytes_in"] for r in later),
            "messages": statistics.median(r["messages"] for r in later),
            "wall_s": round(time.time() - sampled.launched, 1), "peak_pss_mb": round(sampled.peak_pss_mb, 1),
            "model": str(out.with_suffix(".npy"))}


def summarize(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's figures from the three cells (``None`` where a cell has none)."""
    import numpy as np

    def ratio(a: str, b: str, key: str) -> float | None:
        x, y = cells[a].get(key), cells[b].get(key)
        return None if x is None or not y else round(float(x) / float(y), 3)

    flat, tree = cells["flat"], cells["tree"]
    diff = None
    if "model" in flat and "model" in tree:
        diff = float(np.max(np.abs(np.load(flat["model"]) - np.load(tree["model"]))))
    return {"top_bytes_ratio": ratio("flat", "tree", "bytes_in"),
            "top_messages_ratio": ratio("flat", "tree", "messages"),
            "round_time_ratio": ratio("tree", "flat", "round_s"),
            "models_match": diff is not None and diff <= 1e-6, "max_abs_diff": diff,
            "pss_100k_over_10k": ratio("tree-10x", "tree", "peak_pss_mb")}


def table(cells: dict[str, dict[str, Any]]) -> str:
    rows = ["| cell | devices | edges | s / round | bytes to the aggregator / round | messages / round | "
            "peak PSS MB | accuracy |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in cells.values():
        if "error" in c:
            rows.append(f"| {c['cell']} | {c['devices']:,} | {c['edges']:,} | {c['error']} | | | | |")
            continue
        rows.append(f"| {c['cell']} | {c['devices']:,} | {c['edges']:,} | {c['round_s']:.2f} | "
                    f"{c['bytes_in']:,.0f} | {c['messages']:,.0f} | {c['peak_pss_mb']:.0f} | {c['accuracy']:.3f} |")
    return "\n".join(rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="200 devices through 10 edges; 2,000 through 100")
    parser.add_argument("--devices", type=int, help="devices of the flat and the tree run (default 10,000)")
    parser.add_argument("--edges", type=int, help="edges of the tree run (default devices / 100)")
    parser.add_argument("--rounds", type=int, help="rounds of the flat and the tree run (default 4; --quick 3)")
    parser.add_argument("--limit-s", type=float, default=1800.0, help="give up a cell after this")
    parser.add_argument("--child", nargs=4, metavar=("DEVICES", "EDGES", "ROUNDS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.devices = args.devices or (200 if args.quick else 10_000)
    args.edges = args.edges or max(1, args.devices // (20 if args.quick else 100))
    args.rounds = args.rounds or (3 if args.quick else 4)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (time per round is measured after the first)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        devices, edges, rounds, out = args.child
        child(int(devices), int(edges), int(rounds), Path(out))
        return 0
    plan = [("flat", args.devices, 0, args.rounds), ("tree", args.devices, args.edges, args.rounds),
            ("tree-10x", 10 * args.devices, 10 * args.edges, 2)]
    with tempfile.TemporaryDirectory(prefix="quorum-bench-hierarchy-") as work:
        cells = {}
        for name, devices, edges, rounds in plan:
            cell = measure(name, devices, edges, rounds, args.limit_s, Path(work))
            print(json.dumps({k: v for k, v in cell.items() if k != "model"}), file=sys.stderr, flush=True)
            cells[name] = cell
        print(table(cells))
        print(json.dumps({**summarize(cells), "devices": args.devices, "edges": args.edges, "rounds": args.rounds,
                          "cores": len(os.sched_getaffinity(0)), "quick": args.quick}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
