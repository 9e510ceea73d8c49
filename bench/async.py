"""Benchmark: buffered asynchronous aggregation (FedBuff) against synchronous FedAvg on one virtual clock (issue #15).

``scenarios/async-stragglers.toml`` (MNIST 5k, 20 clients, Dirichlet 0.5,
the small CNN, 30% of the clients 10x slower) runs as FedBuff
(``aggregator/fedbuff.py``: 10 clients in flight, a step every 5 replies,
staleness weight 1 / sqrt(1 + s)), and its synchronous twin
``scenarios/async-stragglers-sync.toml`` as FedAvg rounds of 10 sampled
clients that wait for all of them. Training is real in both; time is the same
virtual clock: the twin's round lasts as long as its slowest sampled client
(``DeviceSpeeds.sync_round_time``, the FedBuff run's device speeds). The
server's held-out accuracy after every step or round gives the virtual time
to the target (90%), the accuracy at a fixed virtual time, the final
accuracy and the bytes moved.

    python bench/async.py              # 40 FedBuff steps, 20 sync rounds (minutes)
    python bench/async.py --quick      # digits, 8 clients (seconds)

A third run is the synchronous twin with a deadline of ``--deadline-factor``
median-device round times on the same clock (``VirtualDeadlineGrid``: a
reply that needs longer is turned into a "late" error the round loop records,
and the round lasts until the deadline). Ends with one JSON line of figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flwr.app import Error, Message  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from aggregator.fedbuff import DeviceSpeeds  # noqa: E402
from aggregator.serverapp import run_federation  # noqa: E402
from clients.clientapp import app as client_app  # noqa: E402
from runstore.store import RunStore  # noqa: E402
from runtimes.inprocess import InProcessGrid, NodeSpec  # noqa: E402
from runtimes.simulation import simulate  # noqa: E402
from scenarios.schema import Scenario, load_scenario, scenario_from_dict  # noqa: E402

__all__ = ["main"]

QUICK = {"data": {"dataset": "digits", "partition": "iid", "server_test_fraction": 0.2, "client_test_fraction": 0.0},
         "model": {"name": "logreg"}, "federation": {"clients": 8, "fraction": 0.5, "min_clients": 1,
                                                     "deadline_s": 600.0},
         "training": {"local_epochs": 1, "batch_size": 16, "lr": 0.1}}


def scenarios(args: argparse.Namespace) -> tuple[Scenario, Scenario]:
    """The FedBuff scenario and its synchronous twin, with the run lengths asked for."""
    fedbuff = load_scenario(REPO / "scenarios" / "async-stragglers.toml").to_dict()
    sync = load_scenario(REPO / "scenarios" / "async-stragglers-sync.toml").to_dict()
    fedbuff["rounds"], sync["rounds"] = args.steps, args.rounds
    if args.quick:
        for raw in (fedbuff, sync):
            raw.update({k: {**raw[k], **v} for k, v in QUICK.items()})
        fedbuff["async"].update(concurrency=4, buffer_size=2)
    return (scenario_from_dict(fedbuff, source="bench/async.py:fedbuff"),
            scenario_from_dict(sync, source="bench/async.py:sync"))


class VirtualDeadlineGrid(InProcessGrid):
    """The in-process grid, with a synchronous deadline on the virtual clock.

    A train reply whose client needs longer than ``deadline_s`` virtual seconds
    for that round (``DeviceSpeeds.duration(node, round)``) is turned into an
    error reply ("late"): the round loop folds the others and records the late
    client as dropped, as a real deadline would, without waiting in wall time.
    """

    def __init__(self, *args: Any, speeds: DeviceSpeeds, deadline_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.speeds, self.deadline_s = speeds, deadline_s
        self._sent: dict[str, Message] = {}

    def push_messages(self, messages: Any) -> Any:
        batch = list(messages)
        ids = list(super().push_messages(batch))
        self._sent.update(zip(ids, batch, strict=True))
        return ids

    def pull_messages(self, message_ids: Any) -> Any:
        out = []
        for reply in super().pull_messages(message_ids):
            sent = self._sent.pop(reply.metadata.reply_to_message_id, None)
            if sent is not None and sent.metadata.message_type == "train" and not reply.has_error():
                took = self.speeds.duration(sent.metadata.dst_node_id, int(sent.metadata.group_id))
                if took > self.deadline_s:
                    # the reply is not there at the deadline: to the round loop, a client that did not answer
                    reply = Message(Error(ErrorCode.REPLY_MESSAGE_UNAVAILABLE, f"late: {took:.1f} virtual s > deadline "
                                          f"{self.deadline_s:g} s"), reply_to=sent)
            out.append(reply)
        return out


def run_with_deadline(scenario: Scenario, db: str, speeds: DeviceSpeeds, deadline_s: float) -> str:
    """The synchronous twin with a virtual-clock deadline; returns the run id."""
    n = scenario.federation.clients
    nodes = [NodeSpec(i + 1, {"partition-id": i, "num-partitions": n}) for i in range(n)]
    with VirtualDeadlineGrid(client_app, nodes, {"scenario-json": json.dumps(scenario.to_dict())},
                             speeds=speeds, deadline_s=deadline_s) as grid:
        run_id, _ = run_federation(grid, scenario, RunStore(db), engine="inprocess")
    return run_id


def fedbuff_curve(store: RunStore, run_id: str) -> list[tuple[float, float]]:
    """(virtual time, server accuracy) after every step."""
    return [(float(r.metrics["virtual-time-s"]), float(r.server_accuracy or 0.0)) for r in store.rounds(run_id)]


def sync_curve(store: RunStore, run_id: str, speeds: DeviceSpeeds,
               deadline_s: float | None = None) -> list[tuple[float, float]]:
    """(virtual time, server accuracy) after every round: each round lasts as long as its slowest
    sampled client, or the deadline."""
    now, out = 0.0, []
    for r in store.rounds(run_id):
        sampled = [int(c.client) for c in store.client_results(run_id, r.round)]
        now += speeds.sync_round_time(sampled, r.round, deadline_s)
        out.append((now, float(r.server_accuracy or 0.0)))
    return out


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in curve if acc >= target), None)


def accuracy_at(curve: list[tuple[float, float]], when: float) -> float:
    """The accuracy of the last model released by virtual time ``when`` (0 before the first)."""
    released = [acc for t, acc in curve if t <= when]
    return released[-1] if released else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    fedbuff, sync = scenarios(args)
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'runs.db'}"
        store = RunStore(db)
        started = time.monotonic()
        a = simulate(fedbuff, db_url=db)
        fedbuff_s = time.monotonic() - started
        b = simulate(sync, db_url=db)
        sync_s = time.monotonic() - started - fedbuff_s
        nodes = tuple(range(1, fedbuff.federation.clients + 1))
        speeds = DeviceSpeeds(fedbuff.asynchronous, fedbuff.seed, nodes, fedbuff.training.local_epochs)
        deadline_s = args.deadline_factor * fedbuff.asynchronous.base_time_s * fedbuff.training.local_epochs
        c = run_with_deadline(sync, db, speeds, deadline_s)
        curves = {"fedbuff": fedbuff_curve(store, a.run_id), "sync": sync_curve(store, b.run_id, speeds),
                  "deadline": sync_curve(store, c, speeds, deadline_s)}
        moved = {name: sum(r.bytes_in + r.bytes_out for r in store.rounds(run_id))
                 for name, run_id in (("fedbuff", a.run_id), ("sync", b.run_id), ("deadline", c))}
        late = sum(1 for r in store.rounds(c) for x in store.client_results(c, r.round)
                   if x.outcome == "dropped" and (x.reason or "").startswith("late:"))
    when = min(curve[-1][0] for curve in curves.values())
    reach = {name: time_to(curve, args.target) for name, curve in curves.items()}
    for name, curve in curves.items():
        shown = curve[:: max(1, len(curve) // 8)]
        print(f"{name:>8}: " + "  ".join(f"{t:7.1f}s {100 * acc:5.1f}%" for t, acc in shown), file=sys.stderr)
    def speedup(other: str) -> float | None:
        return reach[other] / reach["fedbuff"] if reach[other] and reach["fedbuff"] else None

    out: dict[str, Any] = {"bench": "async", "quick": args.quick, "target_accuracy": args.target}
    for name in curves:
        out[f"{name}_time_to_target"] = _round(reach[name])
    out.update(speedup_vs_sync=_round(speedup("sync")), speedup_vs_deadline=_round(speedup("deadline")))
    for name, curve in curves.items():
        out[f"{name}_final_accuracy"] = round(100 * curve[-1][1], 2)
    out["fixed_virtual_time_s"] = round(when, 1)
    for name, curve in curves.items():
        out[f"{name}_accuracy_at_fixed_time"] = round(100 * accuracy_at(curve, when), 2)
        out[f"{name}_virtual_time_s"] = round(curve[-1][0], 1)
        out[f"{name}_bytes"] = moved[name]
    out.update(fedbuff_steps=args.steps, sync_rounds=args.rounds, deadline_s=round(deadline_s, 2),
               deadline_late_replies=late, fedbuff_wall_s=round(fedbuff_s, 1), sync_wall_s=round(sync_s, 1),
               stragglers=sorted(speeds.stragglers))
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="digits, 8 clients, logistic regression: seconds")
    parser.add_argument("--steps", type=int, default=40, help="FedBuff server steps")
    parser.add_argument("--rounds", type=int, default=20, help="synchronous rounds")
    parser.add_argument("--target", type=float, default=0.90, help="test accuracy to time")
    parser.add_argument("--deadline-factor", type=float, default=3.0,
                        help="the synchronous deadline, in median-device round times (default 3)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.target = 8, 4, 0.8
    return args


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
