"""Per-round latency of a real deployment: Quorum's loop and agent against Flower's stock loop.

One aggregator host on loopback (SuperLink behind nginx, TLS, node
authentication), then, one after the other in the same Flower run (one
ServerApp: ours first, then the stock loop), each on its own devices:

* **quorum**: the round loop's own push/pull (:mod:`aggregator.collect`, 100 ms
  polling over a SuperLink) to ``quorum client start`` agents (SuperNode with
  ``--poll`` 1 s, the default, and one warm ClientApp worker: no process per
  message);
* **stock**: ``Grid.send_and_receive`` (3 s between pulls) to stock SuperNodes
  (subprocess isolation: SuperExec starts a fresh ``flwr-clientapp`` per
  message; 3 s idle polling).

Both send the same train instruction (the scenario's model) to the same
number of clients for the same number of rounds, handled by the same
ClientApp. Each round is split with the server's clock and the SuperNodes'
log timestamps (one machine, one clock):

    down + client poll   server push  -> SuperNode "Receiving"
    client run            "Receiving"  -> SuperNode "Sending" (process start, training, reply wait)
    training              the ClientApp's own training time (reply metric)
    up + server poll      "Sending"    -> the server has pulled the reply

    python bench/deploy_latency.py            # 2 clients x 5 rounds per side (about 2 min 20 s here)
    python bench/deploy_latency.py --quick    # 1 client x 1 round (35-45 s: start-up dominates)

Ends with one JSON line: ``round_s``, ``stock_round_s``, ``speedup_vs_stock`` and the parts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flwr.app import Context, Message  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

SCENARIO = """
name = "latency"
seed = 1
rounds = {rounds}
[data]
dataset = "digits"
partition = "iid"
[model]
name = "logreg"
[federation]
clients = {clients}
deadline_s = 120.0
[training]
local_epochs = 1
batch_size = 32
lr = 0.1
"""

bench_app = ServerApp()


@bench_app.main()
def _bench_main(grid: Grid, context: Context) -> None:
    """Each loop the run_config names, in turn, on its own nodes; the timings of every round to a file."""
    from learning.federation import cached_federation
    from learning.models import build_model, get_flat
    from scenarios.runconfig import scenario_from_run_config

    config = dict(context.run_config)
    scenario = scenario_from_run_config(config)
    fed = cached_federation(scenario)
    params = get_flat(build_model(scenario.model.name, fed.input_shape, fed.num_classes, seed=scenario.seed))
    loops = json.loads(str(config["nodes"]))  # {"quorum": [node ids], "stock": [node ids]}, run in this order
    timings = {loop: _rounds(grid, scenario, params, loop, [int(n) for n in nodes]) for loop, nodes in loops.items()}
    Path(str(config["out"])).write_text(json.dumps(timings))


def _rounds(grid: Grid, scenario: Any, params: Any, loop: str, nodes: list[int]) -> list[dict[str, Any]]:
    """The scenario's rounds of one train message per node with ``loop``'s push and pull; each round's times."""
    from core.instructions import TrainConfig, train_instruction
    from core.replies import parse_train_reply

    t, rounds = scenario.training, []
    for r in range(1, scenario.rounds + 1):
        cfg = TrainConfig(round=r, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, seed=scenario.seed)
        content = {n: train_instruction(params, cfg) for n in nodes}
        pulled: dict[int, float] = {}
        train_s: dict[int, float] = {}

        def on_reply(node: int, reply: Message, pulled: dict[int, float] = pulled,
                     train_s: dict[int, float] = train_s) -> None:  # this round's dicts, bound now
            pulled[node] = time.time()
            train_s[node] = float(parse_train_reply(reply.content, params.size, 2**28).metrics["duration-s"])

        pushed = time.time()
        if loop == "quorum":
            from aggregator.collect import collect, push

            collect(grid, push(grid, content, "train", r), 120.0, on_reply)
        else:
            messages = [Message(content[n], dst_node_id=n, message_type="train", group_id=str(r)) for n in nodes]
            replies = grid.send_and_receive(messages, timeout=120.0)
            by_id = {m.metadata.message_id: n for m, n in zip(messages, nodes, strict=True)}
            for reply in replies:
                on_reply(by_id.get(reply.metadata.reply_to_message_id, -1), reply)
        rounds.append({"round": r, "pushed": pushed, "done": time.time(), "pulled": pulled, "train_s": train_s})
    return rounds


# ----------------------------------------------------------------------- driver


def _app_dir(work: Path) -> Path:
    app = work / "bench-app"
    app.mkdir(exist_ok=True)
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "quorum-latency-bench"\nversion = "1.0.0"\nlicense = "Apache-2.0"\n'
        'dependencies = []\n\n[tool.flwr.app]\npublisher = "quorum"\n\n'
        '[tool.flwr.app.components]\nserverapp = "bench.deploy_latency:bench_app"\n'
        'clientapp = "clients.clientapp:app"\n\n'
        '[tool.flwr.app.config]\nscenario = ""\nnodes = "{}"\nout = ""\n')
    return app


def _submit(lb, app: Path, run_config: dict[str, str]) -> int:
    """``flwr run`` this benchmark's app through the SuperLink's Control API, as :func:`deploy.flower.submit_run`.

    That one always submits the deployment's own app (``aggregator.serverapp``);
    this benchmark needs its ServerApp in its place, so it builds its own FAB.
    """
    import hashlib

    from flwr.cli.build import build_fab_from_disk
    from flwr.common.serde import fab_to_proto, user_config_to_proto
    from flwr.proto.control_pb2 import StartRunRequest
    from flwr.supercore.fab import Fab

    from deploy.flower import control

    fab = build_fab_from_disk(app)
    request = StartRunRequest(fab=fab_to_proto(Fab(hashlib.sha256(fab).hexdigest(), fab, {})),
                              override_config=user_config_to_proto(dict(run_config)), federation="")
    with control(lb.deploy) as api:
        response = api.StartRun(request)
    if not response.HasField("run_id"):
        raise SystemExit(f"flwr run failed: the SuperLink started no run ({response.note})")
    return int(response.run_id)


def _run(lb, work: Path, scenario: Path, nodes: dict[str, list[int]], timeout_s: float) -> dict[str, list[dict]]:
    """One Flower run: each loop of ``nodes`` in turn on its own nodes; returns each loop's rounds."""
    out = work / "timings.json"
    _submit(lb, _app_dir(work), {"scenario": str(scenario), "nodes": json.dumps(nodes), "out": str(out)})
    deadline = time.monotonic() + timeout_s
    while not out.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"no timings after {timeout_s:g} s (logs in {work}: run with --keep)")
        time.sleep(0.2)
    return json.loads(out.read_text())


def _log_times(log: Path) -> dict[int, dict[str, float]]:
    """Per round: when this SuperNode received its train message and sent the reply."""
    found: dict[int, dict[str, float]] = {}
    current = 0
    for line in log.read_text(errors="replace").splitlines():
        parts = line.split(None, 3)
        if len(parts) < 4 or parts[0] not in ("INFO", "WARNING"):
            continue
        stamp = datetime.datetime.strptime(f"{parts[1]} {parts[2].rstrip(':')}", "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if "ROUND " in line:
            current = int(line.rsplit("ROUND ", 1)[1].rstrip("]"))
        elif "Receiving: train" in line:
            found.setdefault(current, {})["recv"] = stamp
        elif "Sending: train" in line:
            found.setdefault(current, {})["send"] = stamp
    return found


def _parts(rounds: list[dict], logs: dict[int, Path]) -> list[dict[str, float]]:
    """Each round's time, split: the slowest client's path decides the round."""
    times = {n: _log_times(p) for n, p in logs.items()}
    out = []
    for r in rounds:
        node = max(r["pulled"], key=lambda n: r["pulled"][n])
        t = times[int(node)][r["round"]]
        train = r["train_s"][node]
        out.append({"round_s": r["done"] - r["pushed"], "down_poll_s": t["recv"] - r["pushed"],
                    "client_run_s": t["send"] - t["recv"], "train_s": train,
                    "start_and_wait_s": t["send"] - t["recv"] - train, "up_poll_s": r["pulled"][node] - t["send"]})
    return out


def _median(rows: list[dict[str, float]], key: str) -> float:
    """Median over rounds 2.. (round 1 also loads the model and data, and warms torch up); round 1 if alone."""
    steady = rows[1:] or rows
    return statistics.median(row[key] for row in steady)


def _which(rounds: int) -> str:
    return f"median of rounds 2..{rounds}" if rounds > 1 else "round 1 only: it includes the warm-up"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--poll", type=float, default=1.0, help="the Quorum agent's idle poll (its default: 1 s)")
    parser.add_argument("--quick", action="store_true", help="1 client x 1 round per side (the first round's figures)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    args = parser.parse_args()
    clients, rounds = (1, 1) if args.quick else (args.clients, args.rounds)
    work = Path(tempfile.mkdtemp(prefix="quorum-latency-"))
    try:
        result = _bench(work, clients, rounds, args.poll)
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


def _bench(work: Path, clients: int, rounds: int, poll: float) -> dict[str, float]:
    from deploy.enroll import load_registry
    from deploy.flower import flower_env
    from deploy.loopback import LoopbackFederation, Processes, free_ports, write_device_data

    scenario = work / "scenario.toml"
    scenario.write_text(SCENARIO.format(rounds=rounds, clients=clients))
    data = write_device_data(scenario, work / "data")
    procs = Processes(work)
    lb = LoopbackFederation(work, procs, poll_s=poll)
    try:
        lb.start_aggregator()
        names = [f"q{i}" for i in range(clients)] + [f"s{i}" for i in range(clients)]
        for name in names:
            lb.enroll(name)
        ids = {d.name: d.node_id for d in load_registry(lb.deploy).values()}
        stock_logs = {}
        ca = lb.deploy.state.tls / "ca.pem"
        for i in range(clients):  # Flower's own SuperNode: subprocess isolation, 3 s polling (timestamped logs)
            argv = [sys.executable, "-m", "deploy.agent", "supernode", "--poll-s", "3", "--",
                    "--superlink", lb.address, "--root-certificates", str(ca),
                    "--auth-supernode-private-key", str(lb.key(f"s{i}")), "--port", str(free_ports(1)[0]),
                    "--node-config", f'data-path="{data[i]}"']
            node = procs.start(f"stock-s{i}", argv, env=flower_env(lb.deploy, {"FLWR_HOME": str(work / f"s{i}")}))
            stock_logs[ids[f"s{i}"]] = node.log
        for i in range(clients):  # the stock SuperNodes connect meanwhile
            lb.start_agent(f"q{i}", data[i])
        _wait_connected(list(stock_logs.values()))
        quorum_nodes = [ids[f"q{i}"] for i in range(clients)]
        timings = _run(lb, work, scenario, {"quorum": quorum_nodes, "stock": list(stock_logs)}, 900)
        ours_parts = _parts(timings["quorum"], {n: lb.supernode_log(f"q{i}") for i, n in enumerate(quorum_nodes)})
        stock_parts = _parts(timings["stock"], stock_logs)
    finally:
        procs.stop_all()
    return _report(ours_parts, stock_parts, clients, rounds, poll)


def _wait_connected(logs: list[Path], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() and "SuperNode ID:" in p.read_text(errors="replace") for p in logs):
        if time.monotonic() > deadline:
            raise SystemExit("stock SuperNodes did not connect")
        time.sleep(0.2)


def _report(ours: list[dict], stock: list[dict], clients: int, rounds: int, poll: float) -> dict[str, float]:
    keys = ("round_s", "down_poll_s", "client_run_s", "train_s", "start_and_wait_s", "up_poll_s")
    print(f"\ndeployment round latency: {clients} clients x {rounds} rounds per side, one train message "
          f"per client per round, TLS + node auth via nginx ({_which(rounds)})")
    print(f"{'':28}{'quorum':>10}{'stock':>10}")
    labels = {"round_s": "round (push -> last reply)", "down_poll_s": "  down + client poll",
              "client_run_s": "  client run", "train_s": "    training",
              "start_and_wait_s": "    process start + waits", "up_poll_s": "  up + server poll"}
    for key in keys:
        print(f"{labels[key]:28}{_median(ours, key):>9.2f}s{_median(stock, key):>9.2f}s")
    print(f"every round (s), quorum: {[round(r['round_s'], 2) for r in ours]}; "
          f"stock: {[round(r['round_s'], 2) for r in stock]}")
    round_s, stock_s = _median(ours, "round_s"), _median(stock, "round_s")
    print(f"speed-up: {stock_s / round_s:.1f}x (agent poll {poll:g} s; stock: 3 s server sleeps, 3 s SuperNode "
          f"polling, a fresh flwr-clientapp process per message)")
    result = {"round_s": round(round_s, 3), "stock_round_s": round(stock_s, 3),
              "speedup_vs_stock": round(stock_s / round_s, 2), "clients": clients, "rounds": rounds,
              "agent_poll_s": poll, "first_round_s": round(ours[0]["round_s"], 3),
              "stock_first_round_s": round(stock[0]["round_s"], 3)}
    for key in keys[1:]:
        result[key] = round(_median(ours, key), 3)
        result[f"stock_{key}"] = round(_median(stock, key), 3)
    return result


if __name__ == "__main__":
    main()
