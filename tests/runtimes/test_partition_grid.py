"""PartitionGrid and ScenarioClient, the seams between Quorum and Flower's Ray runtime.

Checked without Ray: Flower's simulation hands nodes random ids and an empty
run config; an in-process grid with random node ids and an empty run config
stands in for it, and the run over PartitionGrid must equal the in-process
run record for record, faults included.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict

from aggregator.serverapp import run_federation
from clients.clientapp import app as client_app
from runstore.store import RunStore
from runtimes.enrolment import secagg_identities
from runtimes.faults import FaultPlan
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.ray_engine import NODE_INFO, PartitionGrid, ScenarioClient
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario, wait_for


def _flower_like_grid(scenario, seed: int = 5) -> InProcessGrid:
    """Nodes with random 63-bit ids in shuffled order, and no run config: like ``run_simulation``."""
    n = scenario.federation.clients
    rng = np.random.default_rng(seed)
    ids = [int(x) for x in rng.integers(2**40, 2**62, size=n)]
    nodes = [NodeSpec(ids[i], {"partition-id": int(i), "num-partitions": n}) for i in rng.permutation(n)]
    client = ScenarioClient(client_app, {"scenario-json": json.dumps(scenario.to_dict())},
                            secagg_identities(scenario))  # as run_on_ray enrols them
    return InProcessGrid(client, nodes, run_config={})  # type: ignore[arg-type]


def test_partition_grid_names_nodes_by_partition() -> None:
    # Prepare
    scenario = tiny_scenario(federation={"clients": 5})

    # Execute
    with _flower_like_grid(scenario) as inner:
        grid = PartitionGrid.discover(inner, FaultPlan.none(), expected=5, timeout_s=10)

        # Assert
        assert list(grid.get_node_ids()) == [1, 2, 3, 4, 5]
        ids = list(grid.push_messages([Message(RecordDict(), 3, NODE_INFO, group_id="1")]))
        replies: list[Message] = wait_for(lambda: list(grid.pull_messages(ids)), 10, "the node-info reply",
                                          poll_s=0.01)
        assert replies[0].metadata.src_node_id == 3
        assert replies[0].content.config_records["node"]["partition-id"] == 2


FEDERATIONS = {
    # half the clients per round, a third of them vanish, a fifth send NaNs
    "plain-faults": {"federation": {"clients": 6, "fraction": 0.5, "min_clients": 1, "deadline_s": 10.0},
                     "faults": {"dropouts": {"train": 0.34}, "byzantine": 0.2}},
    # secure aggregation: node ids are protocol identities; a quarter vanish after sharing keys
    "secagg-dropout": {"federation": {"clients": 6, "min_clients": 1, "deadline_s": 10.0},
                       # t = 4 of 6 (strict majority) leaves no slack for a first round that loads data
                       # on a loaded machine: a generous stage deadline
                       "secagg": {"enabled": True, "stage_timeout_s": 120.0},
                       "faults": {"dropouts": {"masked_input": 0.25}}},
}


@pytest.mark.parametrize("name", sorted(FEDERATIONS))
def test_partition_grid_run_equals_the_inprocess_run(name: str, db_url: str) -> None:
    # Prepare
    scenario = tiny_scenario(**FEDERATIONS[name])
    store = RunStore(db_url)

    # Execute
    with _flower_like_grid(scenario) as inner:
        grid = PartitionGrid.discover(inner, FaultPlan.from_spec(scenario.faults, scenario.seed),
                                      expected=6, timeout_s=10)
        remapped, _ = run_federation(grid, scenario, store, engine="partition-test")
    local = simulate(scenario, db_url=db_url, engine="inprocess")

    # Assert
    for a, b in zip(store.rounds(remapped), store.rounds(local.run_id), strict=True):
        assert (a.server_loss, a.server_accuracy, a.fed_loss, a.train_loss) == pytest.approx(
            (b.server_loss, b.server_accuracy, b.fed_loss, b.train_loss), rel=1e-6)
        assert _outcomes(store, remapped, a.round) == _outcomes(store, local.run_id, b.round)
    assert store.get_run(remapped).status == "finished"
    outcomes = {o for r in store.rounds(remapped) for _, o in _outcomes(store, remapped, r.round)}
    assert "ok" in outcomes and len(outcomes) > 1  # the faults did happen


def test_scenario_client_lends_run_config_and_node_id_for_one_call_only() -> None:
    # Prepare
    seen: list[tuple[dict, int, int]] = []

    def fake_app(message: Message, context: Context) -> Message:
        seen.append((dict(context.run_config), context.node_id, message.metadata.dst_node_id))
        return Message(RecordDict(), reply_to=message)

    client = ScenarioClient(fake_app, {"scenario-json": "{}"})  # type: ignore[arg-type]
    context = Context(run_id=1, node_id=987654321, node_config={"partition-id": 4}, state=RecordDict(),
                      run_config={"other": 1})
    with InProcessGrid(client_app, [NodeSpec(1)], run_config={}):  # sets Flower's task identity
        message = Message(RecordDict(), 987654321, "train", group_id="1")
        message.metadata.__dict__["_message_id"] = "m1"

        # Execute
        reply = client(message, context)

    # Assert: the app saw the logical identity; Flower sees its own afterwards
    assert seen == [({"other": 1, "scenario-json": "{}"}, 5, 5)]
    assert (context.run_config, context.node_id) == ({"other": 1}, 987654321)
    assert reply.metadata.src_node_id == 987654321
    assert reply.metadata.reply_to_message_id == "m1"


def _outcomes(store: RunStore, run_id: str, round_: int) -> list[tuple[str, str]]:
    return sorted((c.client, c.outcome) for c in store.client_results(run_id, round_))


def test_a_stopped_runtime_ends_the_run_at_once(db_url: str) -> None:
    # Prepare: the runtime underneath goes away (Ctrl-C) right after round 1
    scenario = tiny_scenario(rounds=3)
    store = RunStore(db_url)
    stopped: list[int] = []

    def alive() -> None:
        if stopped:
            raise KeyboardInterrupt("the Ray simulation was interrupted")

    # Execute
    with _flower_like_grid(scenario) as inner:
        grid = PartitionGrid.discover(inner, FaultPlan.none(), alive, expected=4, timeout_s=10)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            run_federation(grid, scenario, store, engine="partition-test",
                           on_round=lambda r: stopped.append(r.round))

    # Assert: no waiting out deadlines, and the store says what happened
    assert time.monotonic() - started < scenario.federation.deadline_s
    (run,) = store.list_runs()
    assert (run.status, run.rounds_done) == ("interrupted", 1)
