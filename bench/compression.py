"""Benchmark: compressed updates against dense float32 on the quickstart federation (issue #16).

The quickstart federation (MNIST 5k, 20 clients, Dirichlet 0.5, the small
CNN, FedAvg) runs once per method, same seed, same number of rounds:

- ``none``: dense float32 updates (the anchor);
- ``8-bit`` / ``4-bit``: every value stochastically quantised (``[compression] bits``);
- ``top-k 1%``: the 1% largest magnitudes with error feedback (float32 values, their
  coordinates as byte gaps);
- ``top-k 1% 8-bit``: the same, values in 8 bits;
- ``random-k 10% 4-bit``: the round's shared 10% of coordinates (rescaled by 10, no
  error feedback), values in 4 bits;
- ``random-k 10% secagg``: secure aggregation masking only the round's shared 10% of
  coordinates, in its 16-bit ring (``[secagg] bits = 16``); its anchor, ``secagg dense``,
  is secure aggregation's default 32-bit ring over every coordinate (both clip at 0.5).

Bytes are what the run store recorded: every message serialised as Flower's
wire carries it (``core.wire.wire_bytes``), so the secure-aggregation
rows include the protocol's keys, shares and unmasking. For each method: the
uplink bytes until the server's held-out accuracy first reaches the target
(90%), the final accuracy, and the total bytes each way.

    python bench/compression.py            # 20 rounds per method (about 15 minutes here)
    python bench/compression.py --quick    # digits, 6 clients, 3 rounds (seconds)

Ends with one JSON line: ``best_uplink_reduction`` (the anchor's uplink bytes
to the target over the best compressed method's, among methods that reach
it), ``best_method``, ``accuracy_drop_points`` (the anchor's final accuracy
minus that method's, in points) and ``secagg_uplink_reduction`` (dense secure
aggregation's uplink bytes to the target over random-k's; over total uplink
bytes when either misses the target).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from runstore.store import RunStore  # noqa: E402
from runtimes.simulation import simulate  # noqa: E402
from scenarios.schema import Scenario, load_scenario, scenario_from_dict  # noqa: E402

__all__ = ["main", "METHODS"]

#: name -> the [compression] (and [secagg]) sections it adds to the quickstart.
METHODS: dict[str, dict[str, Any]] = {
    "none": {},
    "8-bit": {"compression": {"bits": 8}},
    "4-bit": {"compression": {"bits": 4}},
    "top-k 1%": {"compression": {"topk": 0.01}},
    "top-k 1% 8-bit": {"compression": {"topk": 0.01, "bits": 8}},
    "random-k 10% 4-bit": {"compression": {"randomk": 0.1, "bits": 4}},
    "secagg dense": {"secagg": {"enabled": True, "clip_range": 0.5}},
    "random-k 10% secagg": {"secagg": {"enabled": True, "clip_range": 0.5, "bits": 16},
                            "compression": {"randomk": 0.1}},
}
SECAGG_ANCHOR, SECAGG_METHOD = "secagg dense", "random-k 10% secagg"

QUICK = {"data": {"dataset": "digits", "partition": "iid", "server_test_fraction": 0.2, "client_test_fraction": 0.0},
         "model": {"name": "logreg"}, "federation": {"clients": 6, "fraction": 1.0, "min_clients": 3,
                                                     "deadline_s": 600.0},
         "training": {"local_epochs": 1, "batch_size": 16, "lr": 0.1}}


def scenario(method: str, args: argparse.Namespace) -> Scenario:
    """The quickstart with ``method``'s sections, ``args.rounds`` rounds, server-side evaluation only."""
    raw = load_scenario(REPO / "scenarios" / "quickstart.toml").to_dict()
    raw["rounds"] = args.rounds
    raw["evaluation"] = {**raw["evaluation"], "federated": False}
    if args.quick:
        raw.update({k: {**raw[k], **v} for k, v in QUICK.items()})
    for section, values in METHODS[method].items():
        raw[section] = {**raw[section], **values}
    return scenario_from_dict(raw, source=f"bench/compression.py:{method}")


def figures(store: RunStore, run_id: str, target: float) -> dict[str, Any]:
    """Uplink bytes to the target accuracy, final accuracy, total bytes each way, from the stored rounds."""
    rounds = store.rounds(run_id)
    up, to_target, reached = 0, None, None
    for r in rounds:
        up += r.bytes_in
        if to_target is None and (r.server_accuracy or 0.0) >= target:
            to_target, reached = up, r.round
    return {"uplink_to_target": to_target, "round_to_target": reached,
            "final_accuracy": float(rounds[-1].server_accuracy or 0.0) if rounds else 0.0,
            "uplink_bytes": up, "downlink_bytes": sum(r.bytes_out for r in rounds)}


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{tmp}/bench.db"
        for method in args.methods:
            summary = simulate(scenario(method, args), db_url=db, workers=1 if args.quick else None)
            results[method] = figures(RunStore(db), summary.run_id, args.target)
            print(f"  {method:<22} done: final {results[method]['final_accuracy']:.3f}", file=sys.stderr)
    return results


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON line's figures (see the module docstring)."""
    anchor = results.get("none")
    out: dict[str, Any] = {"best_uplink_reduction": None, "best_method": None, "accuracy_drop_points": None,
                           "secagg_uplink_reduction": None}
    if anchor and anchor["uplink_to_target"]:
        plain = {m: r for m, r in results.items() if "secagg" not in m and m != "none" and r["uplink_to_target"]}
        if plain:
            best = min(plain, key=lambda m: plain[m]["uplink_to_target"])
            out.update(best_method=best,
                       best_uplink_reduction=round(anchor["uplink_to_target"] / plain[best]["uplink_to_target"], 2),
                       accuracy_drop_points=round(100 * (anchor["final_accuracy"] - plain[best]["final_accuracy"]),
                                                  2))
    dense, sparse = results.get(SECAGG_ANCHOR), results.get(SECAGG_METHOD)
    if dense and sparse:
        both = dense["uplink_to_target"] and sparse["uplink_to_target"]
        key = "uplink_to_target" if both else "uplink_bytes"
        out["secagg_uplink_reduction"] = round(dense[key] / sparse[key], 2) if sparse[key] else None
        out["secagg_reduction_basis"] = "to_target" if both else "total"
        out["secagg_accuracy_drop_points"] = round(100 * (dense["final_accuracy"] - sparse["final_accuracy"]), 2)
    return out


def table(results: dict[str, dict[str, Any]], target: float) -> str:
    lines = [f"{'method':<22} {'up to ' + format(target, '.0%'):>14} {'round':>6} {'final acc':>10} "
             f"{'uplink':>12} {'downlink':>12}"]
    for method, r in results.items():
        to = f"{r['uplink_to_target']:,}" if r["uplink_to_target"] else "not reached"
        lines.append(f"{method:<22} {to:>14} {r['round_to_target'] or '-':>6} {r['final_accuracy']:>10.3f} "
                     f"{r['uplink_bytes']:>12,} {r['downlink_bytes']:>12,}")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="digits, 6 clients, 3 rounds (seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per method (default 20; 3 with --quick)")
    parser.add_argument("--target", type=float, default=None, help="accuracy target (default 0.90; 0.80 quick)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="methods to run (default: all; 'none' is the anchor)")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 20
    if args.target is None:
        args.target = 0.80 if args.quick else 0.90
    if args.rounds < 1 or not 0 < args.target <= 1:
        parser.error("--rounds must be >= 1 and --target in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    results = run(args)
    print(table(results, args.target))
    print(json.dumps({**summarize(results), "rounds": args.rounds, "target": args.target, "quick": args.quick,
                      "methods": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
