"""Benchmark: accuracy against privacy for client-level DP-FedAvg (issue #4).

One federation, four noise multipliers (0, 0.3, 0.5, 1.0 by default): final
test accuracy and the epsilon the RDP accountant charges. ``z = 0`` (clipped
updates, no noise) is the anchor the others are compared with, in the same run.

The federation: 100 FedProx Synthetic(1, 1) source devices (Li et al.,
MLSys 2020; ``learning.datasets.synthetic_devices``), each device's training
examples (at most 1,000) dealt into clients of 10: about 2,500 clients, so
that 200 per round is a sampling rate of about 0.08. Multinomial logistic
regression, Poisson sampling, one local epoch, server momentum 0.9.
DP-FedAvg needs many clients per round: the noise on the mean update is
``z C / m`` per coordinate, so with m = 200 even z = 1 adds only 0.005 C per
coordinate per round (McMahan et al., ICLR 2018, section 3). Why not thousands
of separate Synthetic devices: every device draws its own labelling model,
and with 1,000 devices even a centrally trained logistic regression tops out
near 26% test accuracy, which leaves nothing for noise to take away.

The loop is the production path minus the transport: ``sample_clients``,
``DPFedAvg.for_round``, ``learning.training.train`` on each device,
``client_payload`` (clipping on the client), ``accumulate``, ``finalize``
(noise) and ``apply`` (FedAvgM, accountant). Noise and sampling use seeded
generators so runs are comparable (production uses ``secure_rng``).

    python bench/dp_tradeoff.py            # ~2,500 clients, 200 per round, 60 rounds (~1-3 min)
    python bench/dp_tradeoff.py --quick    # ~500 clients, 50 per round, 8 rounds (seconds)

Ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

with warnings.catch_warnings():  # flwr's CLI dependencies (click via typer) warn on import
    warnings.simplefilter("ignore", DeprecationWarning)
    import flwr  # noqa: F401 - imported once here, under the filter, before the layers below import it

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Federation:
    train: list[Any]  # ArrayDataset per device
    test: Any  # union of the devices' test splits


def build(sources: int, per_client: int, cap: int, seed: int) -> Federation:
    """FedProx Synthetic(1, 1) source devices, each dealt into clients of ``per_client`` examples.

    Every source device is split 90/10 into train and test as in the paper;
    its first ``cap`` training examples are dealt, in order, into clients of
    ``per_client`` examples (a smaller remainder is dropped). The test set is
    the union of the devices' test splits, at most ``cap // 9`` per device.
    """
    from learning.datasets import ArrayDataset, synthetic_devices

    train, tests = [], []
    for device in synthetic_devices(1.0, 1.0, sources, np.random.default_rng(seed)):
        cut = int(0.9 * len(device))
        usable = min(cut, cap) // per_client * per_client
        train += [device.subset(np.arange(i, i + per_client)) for i in range(0, usable, per_client)]
        tests.append(device.subset(np.arange(cut, len(device))[:cap // 9]))
    test = ArrayDataset(np.concatenate([t.x for t in tests]), np.concatenate([t.y for t in tests]))
    return Federation(train, test)


def run(fed: Federation, z: float, args: argparse.Namespace) -> dict[str, Any]:
    """Train one DP-FedAvg run with noise multiplier ``z``; return its figures."""
    from aggregator.strategies import FedAvgM
    from learning.models import build_model, get_flat, set_flat
    from learning.training import evaluate, train
    from privacy.dp.mechanisms import client_payload
    from privacy.dp.sampling import sample_clients
    from privacy.dp.strategy import DPFedAvg

    n = len(fed.train)
    dp = DPFedAvg(FedAvgM(server_lr=args.server_lr, momentum=0.9), clip_norm=args.clip, noise_multiplier=z,
                  expected_clients=args.per_round, population=n, delta=args.delta, sampling="poisson")
    model = build_model("logreg", (60,), 10, seed=args.seed)
    state = dp.fresh_state(get_flat(model))
    rng = np.random.default_rng([args.seed, int(z * 1000)])
    started = time.perf_counter()
    for r in range(1, args.rounds + 1):
        bound = dp.for_round(state)
        config = bound.client_dp_config()
        agg = bound.new_aggregate(state.params.size)
        for k in sample_clients(range(n), args.per_round, n, "poisson", rng):
            set_flat(model, state.params)
            result = train(model, fed.train[k], epochs=1, batch_size=args.batch, lr=args.lr, seed=r * n + k)
            delta = get_flat(model) - state.params
            agg = bound.accumulate(agg, client_payload(delta, config, rng), result.num_examples)
        state = bound.apply(state, bound.finalize(agg, rng))
    set_flat(model, state.params)
    eps = dp.epsilon(state)
    return {"z": z, "accuracy": evaluate(model, fed.test).accuracy, "epsilon": eps if math.isfinite(eps) else None,
            "seconds": time.perf_counter() - started}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 source devices, 50 per round, 8 rounds")
    parser.add_argument("--sources", type=int, help="Synthetic(1,1) source devices (100)")
    parser.add_argument("--per-client", type=int, default=10, help="training examples per client")
    parser.add_argument("--cap", type=int, default=1000, help="training examples used per source device")
    parser.add_argument("--per-round", type=int, help="expected clients per round (200)")
    parser.add_argument("--rounds", type=int, help="rounds (60)")
    parser.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.3, 0.5, 1.0])
    parser.add_argument("--clip", type=float, default=1.0, help="clip norm C")
    parser.add_argument("--lr", type=float, default=0.1, help="client SGD step size")
    parser.add_argument("--batch", type=int, default=10, help="client batch size")
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    defaults = (20, 50, 8) if args.quick else (100, 200, 60)
    args.sources = args.sources or defaults[0]
    args.per_round = args.per_round or defaults[1]
    args.rounds = args.rounds or defaults[2]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(1)  # 60-parameter-wide models: threads only contend
    fed = build(args.sources, args.per_client, args.cap, args.seed)
    args.population = len(fed.train)
    print(f"Synthetic(1,1): {args.sources} source devices dealt into {len(fed.train)} clients of "
          f"{args.per_client} examples, {args.per_round} per round (Poisson), "
          f"{args.rounds} rounds, logreg, C = {args.clip}, delta = {args.delta:g}", flush=True)
    print(f"{'z':>5} {'accuracy':>9} {'epsilon':>9} {'seconds':>8}", flush=True)
    results = []
    for z in args.noise:
        row = run(fed, z, args)
        results.append(row)
        eps = "inf" if row["epsilon"] is None else f"{row['epsilon']:.3g}"
        print(f"{z:>5g} {row['accuracy']:>9.4f} {eps:>9} {row['seconds']:>8.1f}", flush=True)
    figures = summarize(args, results)
    print(json.dumps(figures), flush=True)
    return figures


def summarize(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    by_z = {f"{r['z']:g}": r for r in results}
    anchor = by_z.get("0")
    figures: dict[str, Any] = {
        "bench": "dp_tradeoff", "clients": args.population, "per_round": args.per_round, "rounds": args.rounds,
        "rate": round(args.per_round / args.population, 6), "delta": args.delta, "clip": args.clip,
        "accuracy": {k: round(r["accuracy"], 4) for k, r in by_z.items()},
        "epsilon": {k: (None if r["epsilon"] is None else round(r["epsilon"], 4)) for k, r in by_z.items()},
    }
    if anchor is not None and "1" in by_z:
        figures["accuracy_drop_points_z1"] = round(100 * (anchor["accuracy"] - by_z["1"]["accuracy"]), 2)
        figures["accuracy_ratio_z1_over_z0"] = round(by_z["1"]["accuracy"] / anchor["accuracy"], 4)
    return figures


if __name__ == "__main__":
    main()
