"""A deployed tree's message path, in one process: edges reached by messages, their sub-rounds behind a hand-off.

The aggregator's grid here has one node per edge, running Quorum's real
ClientApp with an ``edge-channel`` (as ``quorum aggregator start --edge``
gives its upstream SuperNode); behind each, an :class:`EdgeServer` on a thread
serves the edge's own in-process grid of devices, as the edge's ServerApp
serves its SuperLink. The aggregator only sees the edges: it learns their
devices by asking (:class:`EdgeFleet`). The same scenario run flat is the
independent reference: the two models must agree value by value.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, RecordDict

from aggregator.hierarchy.fleet import EdgeFleet, device_id
from aggregator.hierarchy.serve import EdgeServer
from aggregator.serverapp import build_device_train, build_strategy, run_federation
from clients.clientapp import app as client_app
from core.channel import Channel, Request
from core.partials import devices_reply
from learning.models import layout_of
from learning.task import TaskModel, load_task
from runstore.store import EDGE_METRIC, RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario
from tests.conftest import tiny_scenario

FED = {"clients": 12, "min_clients": 1, "weighting": "capped", "accumulate": "float64", "deadline_s": 30.0}
#: The edges' blocks, as a simulated tree of 3 edges splits devices 1-12: the flat run samples the same ids.
BLOCKS = {"edge-a": [1, 2, 3, 4], "edge-b": [5, 6, 7, 8], "edge-c": [9, 10, 11, 12]}


@dataclass
class Tree:
    """The aggregator's view (``fleet``) and each edge's hand-off folder and server."""

    fleet: EdgeFleet
    channels: dict[str, Channel]
    servers: dict[str, EdgeServer]


def _run_config(scenario: Scenario) -> dict[str, str]:
    return {"scenario-json": json.dumps(scenario.to_dict())}


def _edge_server(scenario: Scenario, grid: InProcessGrid, channel: Channel, name: str, named: bool) -> EdgeServer:
    """The edge's ServerApp as ``aggregator.serverapp._serve_edge`` composes it."""
    model = TaskModel.build(load_task(scenario), scenario.seed)
    fed = scenario.federation
    return EdgeServer(grid, channel, run=1, name=name, train=build_device_train(scenario),
                      strategy=build_strategy(scenario), deadline_s=fed.deadline_s,
                      max_update_bytes=int(fed.max_update_mb * 2**20), layout=layout_of(model.model, model.names),
                      names=(lambda: {d: f"dev{d}" for d in BLOCKS[name]}) if named else (lambda: {}))


@contextmanager
def deployed_tree(tmp_path: Path, scenario: Scenario, serving: tuple[str, ...] = tuple(BLOCKS),
                  named: bool = False, extra: dict[str, list[int]] | None = None) -> Iterator[Tree]:
    """The edges of :data:`BLOCKS` (those in ``serving`` answer), and the aggregator's fleet over them.

    ``named``: the edges name their devices ``dev<n>`` (the aggregator then knows them by name, not by the
    node ids a flat run samples); ``extra``: more nodes on an edge's grid, as ``node_id`` of partition
    ``node_id % 50 - 1``.
    """
    stop = threading.Event()
    config = _run_config(scenario)
    with ExitStack() as stack:
        channels = {name: Channel(tmp_path / name) for name in BLOCKS}
        servers: dict[str, EdgeServer] = {}
        threads = []
        for name in serving:
            nodes = [NodeSpec(d, {"partition-id": d % 50 - 1, "num-partitions": 12})
                     for d in [*BLOCKS[name], *(extra or {}).get(name, [])]]
            grid = stack.enter_context(InProcessGrid(client_app, nodes, config))
            servers[name] = _edge_server(scenario, grid, channels[name], name, named)
            thread = threading.Thread(target=servers[name].serve, args=(600.0, stop.is_set), daemon=True)
            thread.start()
            threads.append(thread)
        top = stack.enter_context(InProcessGrid(
            client_app, [NodeSpec(1000 + i, {"edge-channel": str(channels[name].root)})
                         for i, name in enumerate(BLOCKS)], config))
        try:
            yield Tree(EdgeFleet(top, refresh_s=0.0, query_s=5.0), channels, servers)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)


def _model(db_url: str, run_id: str) -> np.ndarray:
    state = RunStore(db_url).load_state(run_id)
    assert state is not None
    return state.params


def test_edges_reached_by_messages_end_with_the_flat_model(tmp_path: Path, db_url: str) -> None:
    # Arrange: 12 devices; the same scenario flat (simulated), and through 3 deployed-shape edges
    scenario = tiny_scenario(rounds=3, federation={**FED, "clients_per_round": 7}, hierarchy={"edges": 3})
    flat = simulate(tiny_scenario(rounds=3, federation={**FED, "clients_per_round": 7}), db_url=db_url, workers=1)
    store = RunStore(db_url)

    # Act
    with deployed_tree(tmp_path, scenario) as tree:
        run_id, result = run_federation(tree.fleet, scenario, store, engine="inprocess")
        served = {name: server.served for name, server in tree.servers.items()}

    # Assert: the same devices sampled each round, and the same model, value by value
    assert result.status == flat.status == "finished"
    for r in (1, 2, 3):
        assert sorted(c.client for c in store.client_results(run_id, r)) == \
            sorted(c.client for c in store.client_results(flat.run_id, r))
    a, b = _model(db_url, flat.run_id), _model(db_url, run_id)
    assert np.abs(a).max() > 0.05  # a model that moved
    assert np.abs(a - b).max() <= 1e-6
    # each device is recorded under the edge it was under (edges by name: edge-a is 0), with the flat run's loss
    rows = {int(c.client): c for c in store.client_results(run_id, 3)}
    flat_rows = {int(c.client): c for c in store.client_results(flat.run_id, 3)}
    assert {d: c.metrics[EDGE_METRIC] for d, c in rows.items()} == {d: (d - 1) // 4 for d in rows}
    assert all(rows[d].train_loss == pytest.approx(flat_rows[d].train_loss, abs=1e-6) for d in rows)
    # the aggregator's rounds named the edges, and the federated evaluation came through them
    last = store.rounds(run_id)[-1]
    assert {e["name"] for e in last.tree["edges"]} <= set(BLOCKS)
    assert last.fed_accuracy == pytest.approx(store.rounds(flat.run_id)[-1].fed_accuracy, abs=1e-6)
    assert all(n >= 4 for n in served.values())  # a devices query, then a train and an evaluate per round
    assert store.get_run(run_id).info is not None


def test_a_robust_rule_at_deployed_edges_gives_the_simulated_trees_model(tmp_path: Path, db_url: str) -> None:
    # the simulated tree (edges on threads, same blocks) is the reference; the deployed edges fold with the rule
    fed = {**FED, "accumulate": "float32"}  # a robust rule keeps no float64 running sum
    scenario = tiny_scenario(rounds=2, federation=fed, hierarchy={"edges": 3},
                             strategy={"name": "trimmed_mean", "trimmed_mean": {"trim_fraction": 0.25}})
    simulated = simulate(scenario, db_url=db_url, workers=1)
    store = RunStore(db_url)
    with deployed_tree(tmp_path, scenario) as tree:
        run_id, result = run_federation(tree.fleet, scenario, store, engine="inprocess")
    assert result.status == simulated.status == "finished"
    assert store.get_run(run_id).strategy == "trimmed_mean@edges"
    np.testing.assert_allclose(_model(db_url, run_id), _model(db_url, simulated.run_id), atol=1e-6)


def test_an_edge_that_never_answers_loses_its_devices_as_dropped(tmp_path: Path, db_url: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrange: edge-c's SuperNode is connected, but its ServerApp serves nothing (it died)
    scenario = tiny_scenario(rounds=1, federation={**FED, "deadline_s": 2.0}, hierarchy={"edges": 3})
    store = RunStore(db_url)
    with deployed_tree(tmp_path, scenario, serving=("edge-a", "edge-b"), named=False) as tree:
        # the aggregator asks edge-c who is there once; a dead edge never says, so nothing of it is sampled.
        # To model an edge dying after it said so, fix the tree the fleet learnt with edge-c answering once.
        stop = threading.Event()
        answer_once = threading.Thread(target=_answer_query_once, args=(tree.channels["edge-c"], stop), daemon=True)
        answer_once.start()
        tree.fleet.refresh_s = 3600.0  # learn the tree once: edge-c then dies
        tree.fleet.refresh(force=True)
        assert sorted(tree.fleet.get_node_ids()) == list(range(1, 13))
        monkeypatch.setattr("aggregator.hierarchy.tree.EDGE_MARGIN_S", 1.0)  # wait 2 + 1 s for edge-c, not 32
        try:
            run_id, result = run_federation(tree.fleet, scenario, store, engine="inprocess")
        finally:
            stop.set()

    # Assert: the round went on with edges a and b; edge-c's 4 devices dropped, with why
    assert result.status == "degraded"
    rows = {int(c.client): c for c in store.client_results(run_id, 1)}
    assert {d for d, c in rows.items() if c.outcome == "ok"} == set(range(1, 9))
    lost = [rows[d] for d in (9, 10, 11, 12)]
    assert all(c.outcome == "dropped" for c in lost)
    assert all("edge edge-c dropped" in (c.reason or "") for c in lost)
    edges = {e["name"]: e for e in store.rounds(run_id)[-1].tree["edges"]}
    assert (edges["edge-c"]["answered"], edges["edge-c"]["dropped"]) == (0, 4)


def _answer_query_once(channel: Channel, stop: threading.Event) -> None:
    """Play edge-c's ServerApp for one devices query, then die."""
    while not stop.is_set():
        request = channel.take(1)
        if request is not None:
            channel.answer(request, devices_reply("edge-c", {d: "" for d in BLOCKS["edge-c"]}))  # no names
            return
        stop.wait(0.02)


def test_the_fleet_shows_edges_devices_and_refuses_messages_to_them(tmp_path: Path) -> None:
    scenario = tiny_scenario(federation=FED, hierarchy={"edges": 3})
    with deployed_tree(tmp_path, scenario, named=True) as tree:
        ids = {d: device_id(f"dev{d}") for d in range(1, 13)}  # known by name, not by node id
        assert sorted(tree.fleet.get_node_ids()) == sorted(ids.values())
        topology = tree.fleet.topology()
        assert topology.names == ("edge-a", "edge-b", "edge-c")
        assert topology.groups([ids[12], ids[1], ids[5], ids[2]]) == [(0, [ids[1], ids[2]]), (1, [ids[5]]),
                                                                     (2, [ids[12]])]
        assert tree.fleet.device_names()[ids[5]] == "edge-b/dev5"
        with pytest.raises(RuntimeError, match="only through its edge"):
            tree.fleet.push_messages([])  # nothing may reach a device around its edge


def test_a_device_claimed_by_two_edges_is_believed_under_neither(tmp_path: Path) -> None:
    scenario = tiny_scenario(federation=FED, hierarchy={"edges": 3})
    with deployed_tree(tmp_path, scenario, named=False) as tree:
        tree.servers["edge-b"].names = lambda: {}
        real = tree.servers["edge-c"].grid.get_node_ids

        def claims_five() -> list[int]:  # edge-c lies that device 5 (edge-b's) is under it
            return [5, *real()]

        tree.servers["edge-c"].grid.get_node_ids = claims_five  # type: ignore[method-assign]
        tree.fleet.refresh(force=True)
        assert 5 not in tree.fleet.get_node_ids()  # edge-c may be lying, or edge-b: neither is believed
        assert sorted(tree.fleet.get_node_ids()) == [d for d in range(1, 13) if d != 5]
        assert "claimed by edges edge-b, edge-c" in tree.fleet.problems["device 5"]


def test_an_edge_that_fails_answers_why_and_keeps_serving(tmp_path: Path) -> None:
    channel = Channel(tmp_path / "edge")
    server = EdgeServer(grid=None, channel=channel, run=7, name="edge-x", train=None,  # type: ignore[arg-type]
                        strategy=None, deadline_s=5.0, max_update_bytes=1)  # type: ignore[arg-type]
    asked: dict[str, object] = {}

    def ask(kind: str) -> None:
        try:
            asked[kind] = channel.ask(7, kind, RecordDict({"x": ConfigRecord({"a": 1})}), timeout_s=10.0)
        except Exception as exc:  # what the edge's ClientApp would raise: Flower's error reply then names it
            asked[kind] = exc

    for kind in ("train.nonsense", "train.edge"):
        t = threading.Thread(target=ask, args=(kind,))
        t.start()
        deadline = 0
        while server.served < (1 if kind == "train.nonsense" else 2) and deadline < 500:
            request = channel.take(7)
            if request is not None:
                server.answer(request)
            else:
                threading.Event().wait(0.01)
                deadline += 1
        t.join(timeout=15)
    assert "no edge message of type 'train.nonsense'" in str(asked["train.nonsense"])
    assert "edge edge-x" in str(asked["train.edge"])  # an instruction no device could read: its reason, not a hang
    assert server.served == 2


def test_a_deployed_tree_refuses_a_secure_sum_across_edges_by_name() -> None:
    from aggregator.serverapp import _fleet

    scenario = tiny_scenario(federation=FED, hierarchy={"edges": 3, "secure_across_edges": True},
                             secagg={"enabled": True})
    with pytest.raises(ScenarioError, match="secure_across_edges"):
        _fleet(None, scenario)  # type: ignore[arg-type]


def test_request_past_its_deadline_is_dropped_unanswered(tmp_path: Path) -> None:
    channel = Channel(tmp_path / "c")
    with pytest.raises(Exception, match="did not answer"):
        channel.ask(3, "query.edge", RecordDict(), timeout_s=0.2)
    assert channel.take(3) is None  # the asker withdrew it
    assert channel.waiting_runs() == []


def test_channel_carries_a_message_and_the_run_config(tmp_path: Path) -> None:
    channel = Channel(tmp_path / "c")
    got: list[Request] = []

    def serve() -> None:
        for _ in range(500):
            request = channel.take(9)
            if request is not None:
                got.append(request)
                channel.answer(request, RecordDict({"r": ConfigRecord({"n": 2**64 - 1})}))
                return
            threading.Event().wait(0.01)

    t = threading.Thread(target=serve)
    t.start()
    reply = channel.ask(9, "train.edge", RecordDict({"q": ConfigRecord({"v": [1, 2]})}), timeout_s=10.0,
                        run_config={"scenario-json": "{}"})
    t.join(timeout=10)
    assert reply["r"]["n"] == 2**64 - 1  # a Flower node id survives the hand-off
    assert got[0].kind == "train.edge" and list(got[0].content["q"]["v"]) == [1, 2]
    assert "quorum-channel" not in got[0].content
    assert channel.run_config(9) == {"scenario-json": "{}"}


def test_a_device_refuses_an_edges_message_without_touching_its_data() -> None:
    from aggregator.collect import collect, push
    from core.partials import EDGE_QUERY, EDGE_TRAIN

    scenario = tiny_scenario(federation=FED)
    replies: dict[int, object] = {}
    with InProcessGrid(client_app, [NodeSpec(1, {"partition-id": 0, "num-partitions": 12})],
                       _run_config(scenario)) as grid:
        for kind in (EDGE_QUERY, EDGE_TRAIN):
            owed = push(grid, {1: RecordDict()}, kind, 1, ttl=10.0)
            collect(grid, owed, 10.0, lambda node, reply: replies.__setitem__(node, reply))
            reply = replies.pop(1)
            assert reply.has_error()  # type: ignore[attr-defined]
            assert "only an edge aggregator" in reply.error.reason  # type: ignore[attr-defined]


def test_a_device_that_moves_to_another_edge_keeps_its_identity(tmp_path: Path, db_url: str) -> None:
    # Arrange: the edges name their devices; dev5 is node 5 under edge-b in round 1, and after it moves, node 55
    # under edge-c (another edge's SuperLink gives it another node id), with the same data
    scenario = tiny_scenario(rounds=2, federation=FED, hierarchy={"edges": 3})
    store = RunStore(db_url)
    with deployed_tree(tmp_path, scenario, named=True, extra={"edge-c": [55]}) as tree:
        b, c = tree.servers["edge-b"], tree.servers["edge-c"]
        moved = threading.Event()
        b_nodes, c_nodes = b.grid.get_node_ids, c.grid.get_node_ids
        b.grid.get_node_ids = lambda: [n for n in b_nodes() if not (moved.is_set() and n == 5)]  # type: ignore
        c.grid.get_node_ids = lambda: [n for n in c_nodes() if n != 55 or moved.is_set()]  # type: ignore
        c.names = lambda: {**{d: f"dev{d}" for d in BLOCKS["edge-c"]}, 55: "dev5"}

        # Act: the move happens between the rounds
        run_id, result = run_federation(tree.fleet, scenario, store, engine="inprocess",
                                        on_round=lambda _: moved.set())

    # Assert: one id for dev5 in both rounds, trained under edge-b (1) and then edge-c (2), and named so
    dev5 = str(device_id("dev5"))
    assert result.status == "finished", store.get_run(run_id).error
    rows = [{c.client: c for c in store.client_results(run_id, r)} for r in (1, 2)]
    assert [rows[i][dev5].outcome for i in (0, 1)] == ["ok", "ok"]
    assert [rows[i][dev5].metrics[EDGE_METRIC] for i in (0, 1)] == [1, 2]
    assert all(len(r) == 12 for r in rows)  # no second dev5, no stray node id
    assert "55" not in rows[1] and "5" not in rows[1]


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-clip", "adaptive-clip"])
def test_central_dp_through_deployed_edges_releases_the_flat_runs_model(tmp_path: Path, db_url: str,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       adaptive: bool) -> None:
    # Arrange: the DP run's secret sample and noise replaced by one seeded sequence for both runs (the flat run is
    # the reference); the deployed edges hold no DP state: they fold with the clip norm the instruction carries
    import itertools

    dp = {"enabled": True, "noise_multiplier": 0.5, "clip_norm": 0.5, "adaptive_clipping": adaptive}
    fed = {**FED, "accumulate": "float32", "clients_per_round": 6}

    def seeded() -> None:
        seeds = itertools.count(1000)
        monkeypatch.setattr("privacy.dp.strategy.secure_rng", lambda: np.random.default_rng(next(seeds)))

    seeded()
    flat = simulate(tiny_scenario(rounds=3, federation=fed, dp=dp), db_url=db_url, workers=1)
    scenario = tiny_scenario(rounds=3, federation=fed, dp=dp, hierarchy={"edges": 3})
    store = RunStore(db_url)

    # Act
    seeded()
    with deployed_tree(tmp_path, scenario) as tree:
        run_id, result = run_federation(tree.fleet, scenario, store, engine="inprocess")

    # Assert: the same cohorts, the same released model, the same privacy spent (and, adaptive, the same clip)
    assert result.status == flat.status == "finished", store.get_run(run_id).error
    for r in (1, 2, 3):
        assert sorted(c.client for c in store.client_results(run_id, r)) == \
            sorted(c.client for c in store.client_results(flat.run_id, r))
    a, b = _model(db_url, flat.run_id), _model(db_url, run_id)
    assert np.abs(a - b).max() <= 1e-5 and np.abs(a).max() > 0.01
    assert [r.epsilon for r in store.rounds(run_id)] == [r.epsilon for r in store.rounds(flat.run_id)]
    clips = []
    for run in (flat.run_id, run_id):
        state = store.load_state(run)
        assert state is not None
        clips.append(state.wrapper_state["dp"]["clip"])
    assert clips[0] == pytest.approx(clips[1])
    assert (clips[0] != dp["clip_norm"]) == adaptive  # adaptive clipping moved it, through the edges as flat


def test_an_edge_is_named_as_it_was_enrolled_not_as_it_calls_itself(tmp_path: Path) -> None:
    scenario = tiny_scenario(federation=FED, hierarchy={"edges": 3})
    with deployed_tree(tmp_path, scenario) as tree:
        tree.servers["edge-c"].name = "!a-trusted-edge"  # sorts first, and claims another's name
        fleet = EdgeFleet(tree.fleet.inner, refresh_s=0.0, query_s=5.0,
                          enrolled={1000: "edge-a", 1001: "edge-b", 1002: "edge-c"})
        assert fleet.topology().names == ("edge-a", "edge-b", "edge-c")


def test_two_servers_of_one_run_never_take_one_request(tmp_path: Path) -> None:
    first, second = Channel(tmp_path / "c"), Channel(tmp_path / "c")
    folder = tmp_path / "c" / "requests" / "1"
    folder.mkdir(parents=True)
    from flwr.common.serde import recorddict_to_proto

    header = RecordDict({"quorum-channel": ConfigRecord({"kind": "query.edge", "run": 1, "deadline": 4e9})})
    for i in range(20):
        (folder / f"{i:02d}.msg").write_bytes(recorddict_to_proto(header).SerializeToString())
    (folder / "zz.msg").write_bytes(b"not a message")
    taken: list[str] = []
    threads = [threading.Thread(target=lambda ch=ch: [taken.append(r.id) for r in iter(lambda: ch.take(1), None)])
               for ch in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(taken) == [f"{i:02d}" for i in range(20)]  # each once; the junk file dropped, never raised
    assert list(folder.iterdir()) == []


def test_a_late_answer_is_not_written_and_the_folder_is_swept(tmp_path: Path) -> None:
    import os
    import time

    channel = Channel(tmp_path / "c")
    late = Request("r1", 1, "train.edge", RecordDict(), deadline=time.time() - 1)
    channel.answer(late, RecordDict())
    channel.fail(late, "too late")
    assert not (tmp_path / "c" / "replies").exists()
    old = tmp_path / "c" / "replies" / "old.msg"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    fresh = old.with_name("fresh.msg")
    fresh.write_bytes(b"x")
    assert channel.sweep(older_than_s=3600) == 1
    assert not old.exists() and fresh.exists()
    channel.publish_names({5: "ward-1"})
    assert channel.device_names() == {5: "ward-1"}
    (tmp_path / "c" / "names.json").write_text("[not, json")
    assert channel.device_names() == {}


@pytest.mark.parametrize(("created", "wait"), [(0.0, 60.0), (-30.0, 30.0), (-3600.0, 60.0), (3600.0, 60.0)],
                         ids=["fresh", "half-lived", "skewed-past", "skewed-future"])
def test_the_edge_waits_as_long_as_the_message_lives_whatever_the_clocks(monkeypatch: pytest.MonkeyPatch,
                                                                         created: float, wait: float) -> None:
    import time

    from flwr.app import Context, Message

    from clients.edge import forward

    with InProcessGrid(client_app, [NodeSpec(1)], {}):  # sets the task identity a Message needs
        message = Message(RecordDict(), 1, "query.edge", ttl=60.0)
    message.metadata.created_at = time.time() + created
    asked: list[float] = []

    def ask(self: Channel, run: int, kind: str, content: RecordDict, timeout_s: float, **_: object) -> RecordDict:
        asked.append(timeout_s)
        return RecordDict()

    monkeypatch.setattr(Channel, "ask", ask)
    forward(message, Context(run_id=1, node_id=1, node_config={"edge-channel": "/tmp/x"}, state=RecordDict(),
                             run_config={}))
    assert asked[0] == pytest.approx(wait, abs=1.0)
