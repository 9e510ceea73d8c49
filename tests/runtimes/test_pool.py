"""The in-process runtime's worker pool: every core runs clients, and the bits do not change.

The pool runs the same ClientApp in forked processes and ships each node's
context (config and state) with every call; replies are handed out in push
order, so the aggregate folds in the same order as on one worker. At the same
torch threads per client a run is therefore bit-identical to the one-process
run, state-carrying features (error feedback) included. Secure aggregation
rounds with secret randomness, so no two of its runs share bits; on the pool
its multi-stage protocol (keys and shares kept in each node's state) must
still complete every round.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.simulation import simulate
from tests.conftest import REPO, tiny_scenario, wait_for

STATEFUL = {
    # top-k with error feedback: each node's residual lives in its context.state between rounds
    "topk-feedback": {"compression": {"topk": 0.2, "bits": 8}},
}


@pytest.mark.parametrize("extra", [{}, *STATEFUL.values()], ids=["plain", *STATEFUL])
def test_a_pool_of_two_gives_the_one_process_runs_bits(tmp_path, extra: dict) -> None:
    # Prepare / Execute: the same scenario, one torch thread per client, on one process and on two workers
    scenario = tiny_scenario(rounds=3, federation={"clients": 5}, **extra)
    runs = {}
    for workers in (1, 2):
        db = f"sqlite:///{tmp_path / f'w{workers}.db'}"
        summary = simulate(scenario, db_url=db, workers=workers, threads=1)
        store = RunStore(db)
        runs[workers] = (summary.status, store.load_state(summary.run_id).params,
                         [(r.train_loss, r.fed_loss, r.server_loss, r.answered) for r in store.rounds(summary.run_id)])

    # Assert: same status, same per-round figures, the same final model bit for bit
    assert runs[1][0] == runs[2][0] == "finished"
    assert runs[1][2] == runs[2][2]
    assert runs[1][1].dtype == np.float32 and runs[1][1].tobytes() == runs[2][1].tobytes()


def test_secure_aggregation_completes_on_the_pool(db_url: str) -> None:
    # Execute: 4 stages a round, each node's keys and shares carried in its context between them
    scenario = tiny_scenario(rounds=2, federation={"clients": 5}, secagg={"enabled": True})
    summary = simulate(scenario, db_url=db_url, workers=2)

    # Assert: every round summed all five masked updates
    rows = RunStore(db_url).rounds(summary.run_id)
    assert summary.status == "finished"
    assert [(r.answered, r.dropped, r.rejected) for r in rows] == [(5, 0, 0), (5, 0, 0)]


def _grid(app: ClientApp, n: int = 3, workers: int = 2) -> InProcessGrid:
    return InProcessGrid(app, [NodeSpec(i) for i in range(1, n + 1)], run_config={}, workers=workers)


def _ask(grid: InProcessGrid, nodes: list[int]) -> list[Message]:
    ids = list(grid.push_messages([Message(RecordDict(), n, "query", group_id="1") for n in nodes]))
    got: list[Message] = []

    def all_in() -> bool:
        got.extend(grid.pull_messages(ids))
        return len(got) == len(ids)

    wait_for(all_in, 30, "every reply")
    return got


def test_replies_come_out_in_push_order_and_node_state_persists() -> None:
    # Prepare: node 1 is slow, so node 2's reply is ready first; each node counts its calls in its state
    app = ClientApp()

    @app.query()
    def answer(message: Message, context: Context) -> Message:
        if context.node_id == 1:
            time.sleep(0.5)
        calls = int(context.state["count"]["n"]) + 1 if "count" in context.state else 1
        context.state["count"] = ConfigRecord({"n": calls})
        return Message(RecordDict({"r": ConfigRecord({"node": context.node_id, "calls": calls,
                                                      "pid": os.getpid()})}), reply_to=message)

    # Execute
    with _grid(app) as grid:
        first = _ask(grid, [1, 2, 3])
        second = _ask(grid, [1, 2, 3])

    # Assert: push order, in worker processes (not this one), and each node's state carried over
    rows = [m.content["r"] for m in first + second]
    assert [r["node"] for r in rows] == [1, 2, 3, 1, 2, 3]
    assert [r["calls"] for r in rows] == [1, 1, 1, 2, 2, 2]
    assert os.getpid() not in {r["pid"] for r in rows}


def test_two_calls_to_one_node_run_one_after_the_other() -> None:
    # Prepare: a call still running when the node is asked again (a late reply, then the next round)
    app = ClientApp()

    @app.query()
    def answer(message: Message, context: Context) -> Message:
        calls = int(context.state["count"]["n"]) + 1 if "count" in context.state else 1
        time.sleep(0.3)
        context.state["count"] = ConfigRecord({"n": calls})
        return Message(RecordDict({"r": ConfigRecord({"calls": calls})}), reply_to=message)

    # Execute: two messages to node 1 at once, with two workers free
    with _grid(app) as grid:
        replies = _ask(grid, [1, 1])

    # Assert: the second call saw the first one's state; neither overwrote the other
    assert sorted(m.content["r"]["calls"] for m in replies) == [1, 2]


def test_a_worker_that_dies_costs_one_reply_and_is_replaced() -> None:
    # Prepare: node 2's call kills its worker process outright
    app = ClientApp()

    @app.query()
    def answer(message: Message, context: Context) -> Message:
        if context.node_id == 2 and "died" not in context.state:
            os._exit(7)
        return Message(RecordDict({"r": ConfigRecord({"node": context.node_id})}), reply_to=message)

    # Execute
    with _grid(app) as grid:
        replies = _ask(grid, [1, 2, 3])
        again = _ask(grid, [1, 3])

    # Assert: node 2 answers with an error naming the exit code; the others, and later calls, are served
    errors = {m.metadata.src_node_id: m.error.reason
              for m in replies if m.has_error()}
    assert list(errors.values()) == ["client worker process died (exit code 7)"]
    assert sorted(m.content["r"]["node"] for m in replies if not m.has_error()) == [1, 3]
    assert sorted(m.content["r"]["node"] for m in again) == [1, 3]



def test_a_reply_that_cannot_cross_the_pipe_is_an_error_and_the_worker_lives() -> None:
    # Prepare: node 2 slips a function past Flower's checks into its reply and into its state
    app = ClientApp()

    @app.query()
    def answer(message: Message, context: Context) -> Message:
        record = ConfigRecord({"node": context.node_id, "pid": os.getpid()})
        if context.node_id == 2 and "tried" not in context.state:
            context.state["tried"] = ConfigRecord({"yes": True})
            record.__dict__["_data"]["sneaky"] = lambda: None  # bypasses the record's value check
        return Message(RecordDict({"r": record}), reply_to=message)

    # Execute
    with _grid(app) as grid:
        replies = _ask(grid, [1, 2, 3])
        again = _ask(grid, [2])

    # Assert: node 2's reply is an error naming why (its worker did not die); the others are served;
    # node 2's state stayed as it was before the failed call, so its next call fails the same way
    errors = [m.error.reason for m in replies + again if m.has_error()]
    assert len(errors) == 2
    assert all(e.startswith("client worker: the reply cannot reach the aggregator (") for e in errors)
    assert sorted(m.content["r"]["node"] for m in replies if not m.has_error()) == [1, 3]

def test_simulate_refuses_fewer_than_one_worker(db_url: str) -> None:
    from scenarios.errors import ScenarioError

    with pytest.raises(ScenarioError, match="workers must be at least 1, got 0"):
        simulate(tiny_scenario(), db_url=db_url, workers=0)


ORPHAN = textwrap.dedent("""
    import time
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.clientapp import ClientApp
    from runtimes.inprocess import InProcessGrid, NodeSpec
    app = ClientApp()

    @app.query()
    def answer(message, context):
        return Message(RecordDict({"r": ConfigRecord({"ok": 1})}), reply_to=message)

    grid = InProcessGrid(app, [NodeSpec(1), NodeSpec(2)], run_config={}, workers=2)
    ids = list(grid.push_messages([Message(RecordDict(), n, "query", group_id="1") for n in (1, 2)]))
    got = []
    while len(got) < 2:
        got.extend(grid.pull_messages(ids))
        time.sleep(0.01)
    print(" ".join(str(w.process.pid) for w in grid._pool._all), flush=True)
    time.sleep(120)
""")


@pytest.mark.e2e
def test_workers_exit_when_the_aggregator_is_killed() -> None:
    # Prepare: an aggregator process with two forked workers, each of which has served a call
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the aggregator printed no worker PIDs in 60 s"
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(workers) == 2

        # Execute: SIGKILL, so no clean-up of its own runs
        proc.kill()
        proc.wait(timeout=10)

        # Assert: both workers notice and exit by themselves
        wait_for(lambda: not any(_alive(pid) for pid in workers), 10, "the orphaned workers to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
