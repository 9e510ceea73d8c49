"""Benchmark: Quorum's secure aggregation against Flower 1.42's SecAgg and SecAgg+.

One process, one round, the same inputs for all (``--clients`` x ``--params``
float32, example counts as weights, ``--dropout`` vanishing before the masked
input), every protocol over the same in-process Flower ``Grid`` (:class:`SyncGrid`).
Flower SecAgg+ gets our neighbourhood size and threshold; Flower SecAgg (~10 min at
100 x 1M) runs at ``--flower-secagg-clients`` (40; ours re-run there for the ratio)
unless ``--flower-clients 100``. Ours runs in both threat models, the semi-honest
round (the ``*_round_s`` figures) and the actively secure one (``malicious_*``:
signed keys, consistency check; every client enrolled); ``malicious_overhead`` is
the larger of the two graphs' malicious / semi-honest time ratios, same run.
Ends with one JSON line; ``--quick`` takes seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

with warnings.catch_warnings():  # flwr's CLI deps (click via typer) warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    import flwr  # noqa: F401

from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from privacy.secagg import SecAggConfig, SecureSumResult, Stage  # noqa: E402
from privacy.secagg.flower_mod import secagg_mod  # noqa: E402
from privacy.secagg.flower_workflow import run_secagg  # noqa: E402
from privacy.secagg.identity import node_config  # noqa: E402
from runtimes.syncgrid import SERVER_NODE, SyncGrid, stage_name  # noqa: E402

__all__ = ["main"]

FIRST_NODE = 1000


@dataclass(frozen=True)
class Inputs:
    """Updates, example counts and who drops (a fixed fraction), shared by every protocol."""

    nodes: list[int]
    updates: dict[int, np.ndarray]
    examples: dict[int, int]
    dropout: float
    seed: int

    @classmethod
    def draw(cls, clients: int, params: int, dropout: float, seed: int) -> Inputs:
        rng = np.random.default_rng(seed)
        nodes = list(range(FIRST_NODE, FIRST_NODE + clients))
        return cls(nodes, {u: rng.uniform(-1, 1, params).astype(np.float32) for u in nodes},
                   {u: int(rng.integers(50, 1001)) for u in nodes}, dropout, seed)

    def subset(self, clients: int) -> Inputs:
        nodes = self.nodes[:clients]
        return Inputs(nodes, {u: self.updates[u] for u in nodes}, {u: self.examples[u] for u in nodes},
                      self.dropout, self.seed)

    @property
    def params(self) -> int:
        return self.updates[self.nodes[0]].shape[0]

    @cached_property
    def dropped(self) -> set[int]:
        count = int(round(self.dropout * len(self.nodes)))
        picks = np.random.default_rng(self.seed + 1).choice(len(self.nodes), count, replace=False)
        return {self.nodes[i] for i in picks}

    def plain(self, survivors: Iterable[int]) -> tuple[np.ndarray, float]:
        total, weight = np.zeros(self.params), 0.0
        for u in survivors:
            total += self.examples[u] * self.updates[u].astype(np.float64)
            weight += self.examples[u]
        return total, weight


# -- ours -----------------------------------------------------------------------
def _our_app(inputs: Inputs) -> ClientApp:
    app = ClientApp()

    @app.train(mods=[secagg_mod])
    def train(message: Message, context: Context) -> Message:  # noqa: ARG001 (Flower's handler signature)
        node = message.metadata.dst_node_id
        content = RecordDict({
            "update": ArrayRecord({"delta": Array(inputs.updates[node])}),
            "metrics": MetricRecord({"num-examples": inputs.examples[node], "train-loss": 0.0}),
        })
        return Message(content, reply_to=message)

    return app


def run_ours(inputs: Inputs, graph: str, degree: int | None, threat_model: str = "semi-honest") -> dict:
    def drop(m: Message) -> bool:
        return stage_name(m) == Stage.MASKED_INPUT.value and m.metadata.dst_node_id in inputs.dropped

    # Simulation enrolment (identity keys, directory) happens before the round, as out of band.
    grid = SyncGrid(_our_app(inputs), inputs.nodes, drop, node_configs=node_config(inputs.nodes, threat_model))
    config = SecAggConfig(graph=graph, degree=degree, max_weight=1000.0, stage_timeout_s=600.0,
                          threat_model=threat_model)
    model = RecordDict({"model": ArrayRecord({"w": Array(np.zeros(inputs.params, np.float32))})})
    start, cpu = time.perf_counter(), time.process_time()
    result = run_secagg(grid, inputs.nodes, model, config, server_round=1, rng=np.random.default_rng(0))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    report = _our_report(inputs, graph, result, seconds, grid) | {"cpu_s": cpu}
    return report | ({"name": f"ours {graph}, malicious model"} if threat_model == "malicious" else {})


def _our_report(inputs: Inputs, graph: str, result: SecureSumResult, seconds: float, grid: SyncGrid) -> dict:
    total, weight = inputs.plain(result.survivors)
    rows = [(s.stage.value, len(s.completed), *(getattr(grid, k).get(s.stage.value, 0) / max(len(s.completed), 1)
                                                 for k in ("bytes_up", "client_seconds")),
             s.server_seconds, s.seconds) for s in result.stages]
    return {"name": f"ours {graph}", "clients": len(inputs.nodes), "round_s": seconds, "rows": rows,
            "upload_per_client": sum(r[2] for r in rows), "sum_error": float(np.abs(result.total - total).max()),
            "mean_error": float(np.abs(result.mean - total / weight).max()),
            "error_bound": result.error_bound, "weight_error": abs(result.total_weight - weight)}


# -- Flower's SecAgg / SecAgg+ (legacy API) ----------------------------------------
def _flower_workflows() -> tuple[type, type]:
    from flwr.server.workflow import SecAggPlusWorkflow, SecAggWorkflow

    def timed(name: str, method: Callable) -> Callable:
        def wrapper(self, grid, context, state):  # type: ignore[no-untyped-def]
            start, client, cpu = time.perf_counter(), sum(grid.client_seconds.values()), time.process_time()
            ok = method(self, grid, context, state)
            self.cpu_s += time.process_time() - cpu
            alive = max(len(state.active_node_ids), 1)
            client = sum(grid.client_seconds.values()) - client
            up = grid.bytes_up.get(name, 0)
            total = time.perf_counter() - start
            self.rows.append((name, len(state.active_node_ids), up / alive, client / alive,
                              total - client, total))
            return ok
        return wrapper

    def make(base: type) -> type:
        names = ("setup_stage", "share_keys_stage", "collect_masked_vectors_stage", "unmask_stage")
        return type(f"Timed{base.__name__}", (base,),
                    {n: timed(n.removesuffix("_stage"), getattr(base, n)) for n in names})
    return make(SecAggWorkflow), make(SecAggPlusWorkflow)


def run_flower(inputs: Inputs, plus: bool, shares: int, threshold: int) -> dict:
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow

    class Client(NumPyClient):
        def __init__(self, node: int) -> None:
            self.node = node

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]  # noqa: ARG002 (NumPyClient's)
            return [inputs.updates[self.node]], inputs.examples[self.node], {}

    def drop(m: Message) -> bool:
        return stage_name(m) == "collect_masked_vectors" and m.metadata.dst_node_id in inputs.dropped

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        app = ClientApp(client_fn=lambda ctx: Client(ctx.node_id).to_client(), mods=[secaggplus_mod])
    grid = SyncGrid(app, inputs.nodes, drop)
    n = len(inputs.nodes)
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                      initial_parameters=ndarrays_to_parameters([np.zeros(inputs.params, np.float32)]))
    secagg, secaggplus = _flower_workflows()
    workflow = (secaggplus(shares, threshold, max_weight=1000.0, clipping_range=1.0) if plus
                else secagg(threshold, max_weight=1000.0, clipping_range=1.0))
    workflow.rows, workflow.cpu_s = [], 0.0
    context = LegacyContext(Context(1, SERVER_NODE, {}, RecordDict(), {}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    DefaultWorkflow(fit_workflow=workflow)(grid, context)
    # The fit round alone (its four stages), as for ours: not DefaultWorkflow's set-up.
    mean = context.state.array_records["parameters"].to_numpy_ndarrays()[0].astype(np.float64)
    total, weight = inputs.plain(u for u in inputs.nodes if u not in inputs.dropped)
    return {"name": "Flower SecAgg+" if plus else "Flower SecAgg", "clients": n,
            "round_s": sum(row[-1] for row in workflow.rows), "cpu_s": workflow.cpu_s, "rows": workflow.rows,
            "upload_per_client": sum(r[2] for r in workflow.rows),
            "mean_error": float(np.abs(mean - total / weight).max())}


def _print_run(run: dict, model_bytes: int) -> None:
    print(f"\n{run['name']}: {run['clients']} clients, whole round {run['round_s']:.2f} s "
          f"({run['cpu_s']:.2f} s CPU), "
          f"upload/client {run['upload_per_client'] / 1e6:.3f} MB "
          f"({run['upload_per_client'] / model_bytes:.3f}x float32 model)")
    print(f"  {'stage':<24}{'done':>6}{'up/client B':>14}{'client s (avg)':>16}{'server s':>10}{'total s':>10}")
    for name, done, up, client, server, total in run["rows"]:
        print(f"  {name:<24}{done:>6}{up:>14.0f}{client:>16.4f}{server:>10.3f}{total:>10.3f}")
    print("  " + ", ".join(f"{k} {run[k]:.3g}" for k in ("sum_error", "mean_error", "error_bound") if k in run))


def _ratio(anchor: dict | None, ours: dict | None, key: str = "round_s") -> float | None:
    return round(anchor[key] / ours[key], 2) if anchor and ours else None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--params", type=int, default=1_000_000)
    p.add_argument("--dropout", type=float, default=0.1, help="fraction dropping before masked input")
    p.add_argument("--degree", type=int, default=None, help="k-regular degree (default ceil(3 log2 n))")
    p.add_argument("--flower-clients", type=int, default=None, help="clients for both Flower anchors")
    p.add_argument("--flower-secagg-clients", type=int, default=None, help="default 40 (--quick: all)")
    p.add_argument("--flower-secaggplus-clients", type=int, default=None, help="default: --clients")
    p.add_argument("--skip-flower", action="store_true", help="measure ours only")
    p.add_argument("--quick", action="store_true", help="10 clients x 10k params")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.clients, args.params = (10, 10_000) if args.quick else (args.clients, args.params)
    if args.flower_clients is not None:
        args.flower_secagg_clients = args.flower_secaggplus_clients = args.flower_clients
    args.flower_secagg_clients = min(args.flower_secagg_clients or (10 if args.quick else 40), args.clients)
    args.flower_secaggplus_clients = min(args.flower_secaggplus_clients or args.clients, args.clients)
    return args


def _anchors(args: argparse.Namespace, inputs: Inputs, runs: dict) -> dict:
    """Flower's SecAgg+ and SecAgg, and ours re-run at their sizes where smaller."""
    out = {}
    for key, n, graph in (("plus", args.flower_secaggplus_clients, "kregular"),
                          ("agg", args.flower_secagg_clients, "complete")):
        config = SecAggConfig(graph=graph, degree=args.degree, threat_model="semi-honest")
        out[f"flower_{key}"] = run_flower(inputs.subset(n), graph == "kregular",
                                          config.degree_for(n) + 1, config.threshold_for(n))
        out[f"ours_{key}"] = runs[graph]
        if n != len(inputs.nodes):
            rerun = run_ours(inputs.subset(n), graph, args.degree)
            out[f"ours_{key}"] = rerun | {"name": f"{rerun['name']} (at Flower's n={n})"}
    return out


def _rounded(run: dict | None) -> float | None:
    return round(run["round_s"], 3) if run else None


def _figures(args: argparse.Namespace, inputs: Inputs, runs: dict) -> dict:
    complete, kregular = runs["complete"], runs["kregular"]
    agg, plus = runs.get("flower_agg"), runs.get("flower_plus")
    model_bytes = 4 * args.params
    sparse = SecAggConfig(graph="kregular", degree=args.degree)
    return _malicious_figures(runs) | {
        "clients": args.clients, "params": args.params, "dropped": len(inputs.dropped),
        "degree": sparse.degree_for(args.clients), "threshold_kregular": sparse.threshold_for(args.clients),
        "complete_round_s": _rounded(complete), "kregular_round_s": _rounded(kregular),
        "complete_round_cpu_s": round(complete["cpu_s"], 3), "kregular_round_cpu_s": round(kregular["cpu_s"], 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "flower_secagg_clients": agg and agg["clients"], "flower_secagg_round_s": _rounded(agg),
        "ours_complete_at_flower_secagg_clients_s": _rounded(runs.get("ours_agg")),
        "flower_secaggplus_clients": plus and plus["clients"], "flower_secaggplus_round_s": _rounded(plus),
        "ours_kregular_at_flower_secaggplus_clients_s": _rounded(runs.get("ours_plus")),
        "speedup_vs_flower_secagg": _ratio(agg, runs.get("ours_agg")),
        "speedup_vs_flower_secaggplus": _ratio(plus, runs.get("ours_plus")),
        "speedup_vs_flower_secagg_cpu": _ratio(agg, runs.get("ours_agg"), "cpu_s"),
        "speedup_vs_flower_secaggplus_cpu": _ratio(plus, runs.get("ours_plus"), "cpu_s"),
        "upload_ratio": round(max(complete["upload_per_client"], kregular["upload_per_client"]) / model_bytes, 4),
        "flower_upload_ratio": round(plus["upload_per_client"] / model_bytes, 4) if plus else None,
        "max_abs_error": max(complete["sum_error"], kregular["sum_error"]),
        "error_bound": complete["error_bound"],
        "max_abs_error_mean": max(complete["mean_error"], kregular["mean_error"]),
        "flower_max_abs_error_mean": plus["mean_error"] if plus else None,
    }


def _malicious_figures(runs: dict) -> dict:
    """The actively secure round against the semi-honest one of the same run."""
    ratios = {g: runs[f"malicious_{g}"]["round_s"] / runs[g]["round_s"] for g in ("complete", "kregular")}
    cpu = {g: runs[f"malicious_{g}"]["cpu_s"] / runs[g]["cpu_s"] for g in ("complete", "kregular")}
    plus = runs.get("flower_plus")
    same_n = plus is not None and plus["clients"] == runs["kregular"]["clients"]
    return {
        "malicious_complete_round_s": _rounded(runs["malicious_complete"]),
        "malicious_kregular_round_s": _rounded(runs["malicious_kregular"]),
        "malicious_overhead": round(max(ratios.values()), 3),
        "malicious_overhead_complete": round(ratios["complete"], 3),
        "malicious_overhead_kregular": round(ratios["kregular"], 3),
        "malicious_overhead_cpu": round(max(cpu.values()), 3),
        "malicious_speedup_vs_flower_secaggplus": _ratio(plus, runs["malicious_kregular"]) if same_n else None,
        "malicious_speedup_vs_flower_secaggplus_cpu": (_ratio(plus, runs["malicious_kregular"], "cpu_s")
                                                       if same_n else None),
    }


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the tables, and return (and print) the JSON figures."""
    args = _parse(argv)
    logging.getLogger("flwr").setLevel(logging.ERROR)
    inputs = Inputs.draw(args.clients, args.params, args.dropout, args.seed)
    print(f"secure aggregation, one round, one process, in-process Flower Grid: {args.clients} clients "
          f"x {args.params} params, {len(inputs.dropped)} drop before the masked input")
    runs = {}
    for graph, degree in (("complete", None), ("kregular", args.degree)):  # interleaved: same load
        runs[graph] = run_ours(inputs, graph, degree)
        runs[f"malicious_{graph}"] = run_ours(inputs, graph, degree, "malicious")
    if not args.skip_flower:
        runs |= _anchors(args, inputs, runs)
    for run in {id(r): r for r in runs.values()}.values():
        _print_run(run, 4 * args.params)
    figures = _figures(args, inputs, runs)
    print("\nFlower anchors skipped (--skip-flower)" if args.skip_flower else
          f"\nspeed-ups compare rounds of the same size: Flower SecAgg ran at "
          f"{figures['flower_secagg_clients']} clients, SecAgg+ at {figures['flower_secaggplus_clients']}")
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
