"""Edge aggregators in simulation: a tree of partial sums ends with flat FedAvg's model, and a lying edge loses.

The equivalence is worked out independently: the same scenario runs flat and
through edges, and the two stored models are compared value by value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from flwr.serverapp import Grid

from aggregator.hierarchy.topology import Topology
from aggregator.hierarchy.tree import TreeTrain
from aggregator.serverapp import build_train
from core import aggregate
from core.errors import UpdateRejected
from core.instructions import TrainConfig
from core.partials import eval_partial_reply, parse_eval_partial
from core.records import ClientRecord
from core.status import ClientStatus
from core.strategy import MeanStrategy, ServerState, Strategy
from core.train import TrainOutcome, TrainRequest
from core.weighting import WeightPolicy
from runstore.store import EDGE_METRIC, RunStore
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
from tests.conftest import tiny_scenario

FED = {"clients": 12, "min_clients": 1, "weighting": "capped", "accumulate": "float64"}


def _model(db_url: str, run_id: str) -> np.ndarray:
    state = RunStore(db_url).load_state(run_id)
    assert state is not None
    return state.params


def _sampled(db_url: str, run_id: str) -> list[list[str]]:
    store = RunStore(db_url)
    return [sorted(c.client for c in store.client_results(run_id, r.round)) for r in store.rounds(run_id)]


def test_a_tree_of_three_edges_ends_with_the_flat_model(db_url: str) -> None:
    # Execute: one scenario, 12 devices, flat and through 3 edges of 4 devices each
    flat = simulate(tiny_scenario(rounds=3, federation=FED), db_url=db_url, workers=1)
    tree = simulate(tiny_scenario(rounds=3, federation=FED, hierarchy={"edges": 3}), db_url=db_url, workers=1)

    # Assert: both learn, and their models agree to float32's rounding of each edge's sum
    assert flat.status == tree.status == "finished"
    assert flat.final_accuracy > 0.6  # ten classes: 0.1 by chance
    a, b = _model(db_url, flat.run_id), _model(db_url, tree.run_id)
    assert np.abs(a - b).max() <= 1e-6
    assert np.abs(a).max() > 0.05  # a model that moved: agreement of two untouched models proves nothing
    assert tree.final_train_loss == pytest.approx(flat.final_train_loss, abs=1e-6)
    # every device is recorded as a flat round records it, each with its edge: devices 1-4 under edge 0, ...
    store = RunStore(db_url)
    rows = store.client_results(tree.run_id, 3)
    assert sorted(int(c.client) for c in rows) == list(range(1, 13))
    assert {int(c.client): c.metrics[EDGE_METRIC] for c in rows} == {d: (d - 1) // 4 for d in range(1, 13)}
    assert all(c.outcome == "ok" for c in rows)
    # the aggregator received three partial sums, each about one device reply's size, not twelve replies
    last_tree, last_flat = store.rounds(tree.run_id)[-1], store.rounds(flat.run_id)[-1]
    edges = last_tree.tree["edges"]
    assert [e["edge"] for e in edges] == [0, 1, 2]
    assert [(e["sampled"], e["answered"], e["dropped"]) for e in edges] == [(4, 4, 0)] * 3
    per_device = last_flat.bytes_in / 12
    assert last_tree.bytes_in == sum(e["bytes_up"] for e in edges)
    assert 3 * per_device < last_tree.bytes_in < 3 * (per_device + 1024)  # the device rows ride along
    assert last_tree.tree["bytes_devices"] == last_flat.bytes_in  # the edges received what the flat top did


def test_the_tree_samples_the_devices_a_flat_run_samples(db_url: str) -> None:
    fed = {**FED, "clients_per_round": 5}
    flat = simulate(tiny_scenario(rounds=3, federation=fed), db_url=db_url, workers=1)
    tree = simulate(tiny_scenario(rounds=3, federation=fed, hierarchy={"edges": 4}), db_url=db_url, workers=1)
    assert _sampled(db_url, flat.run_id) == _sampled(db_url, tree.run_id)
    assert all(len(r) == 5 for r in _sampled(db_url, tree.run_id))
    assert np.abs(_model(db_url, flat.run_id) - _model(db_url, tree.run_id)).max() <= 1e-6
    # an edge none of whose devices was sampled is not asked: at most 4 rows, never an edge with 0 sampled
    for r in RunStore(db_url).rounds(tree.run_id):
        assert 1 <= len(r.tree["edges"]) <= 4 and all(e["sampled"] >= 1 for e in r.tree["edges"])
        assert sum(e["sampled"] for e in r.tree["edges"]) == 5


def test_devices_dropped_under_an_edge_are_dropped_as_in_the_flat_run(db_url: str) -> None:
    faults = {"dropouts": {"train": 0.3}}
    flat = simulate(tiny_scenario(rounds=2, federation=FED, faults=faults), db_url=db_url, workers=1)
    tree = simulate(tiny_scenario(rounds=2, federation=FED, faults=faults, hierarchy={"edges": 3}),
                    db_url=db_url, workers=1)
    store = RunStore(db_url)
    for r_flat, r_tree in zip(store.rounds(flat.run_id), store.rounds(tree.run_id), strict=True):
        assert r_flat.dropped == r_tree.dropped >= 1
        assert sum(e["dropped"] for e in r_tree.tree["edges"]) == r_tree.dropped
        dropped = lambda run, n: sorted(c.client for c in store.client_results(run, n)  # noqa: E731
                                        if c.outcome == "dropped")
        assert dropped(flat.run_id, r_flat.round) == dropped(tree.run_id, r_tree.round)
    assert np.abs(_model(db_url, flat.run_id) - _model(db_url, tree.run_id)).max() <= 1e-6


def test_secure_aggregation_inside_each_edge_gives_the_flat_model(db_url: str) -> None:
    # 64-bit ring: quantisation error ~ n^2 x clip / 2^63 per coordinate, far below the 1e-6 asked
    secagg = {"enabled": True, "bits": 64, "clip_range": 4.0}
    flat = simulate(tiny_scenario(rounds=2, federation=FED), db_url=db_url, workers=1)
    tree = simulate(tiny_scenario(rounds=2, federation=FED, secagg=secagg, hierarchy={"edges": 3}),
                    db_url=db_url, workers=1)
    assert tree.status == "finished"
    assert np.abs(_model(db_url, flat.run_id) - _model(db_url, tree.run_id)).max() <= 1e-6
    rows = RunStore(db_url).rounds(tree.run_id)[-1].tree["edges"]
    assert [(e["sampled"], e["answered"]) for e in rows] == [(4, 4)] * 3


# ------------------------------------------------------------------ the aggregator's checks on an edge's sum


class _Grid:
    """Just enough of a grid for a tree: its devices (no edge workflow here sends a message)."""

    thread_safe = True

    def __init__(self, devices: int) -> None:
        self.devices = list(range(1, devices + 1))

    def get_node_ids(self) -> list[int]:
        return self.devices


class _Edge:
    """An edge workflow that folds a fixed update per device; ``lie`` forges what it reports."""

    def __init__(self, update: np.ndarray, lie: dict[int, str] | None = None) -> None:
        self.update, self.lie = update, lie or {}

    def __call__(self, grid: Grid, request: TrainRequest, strategy: Strategy[Any]) -> TrainOutcome[Any]:  # noqa: ARG002
        nodes = list(request.nodes)
        agg = aggregate.widened(strategy.new_aggregate(self.update.size), "float64")
        for n in nodes:
            agg = aggregate.add(agg, self.update * n, float(n))  # device n: n examples, update n x u
        rows = [ClientRecord(client=str(n), outcome=ClientStatus.OK, num_examples=n, train_loss=float(n))
                for n in nodes]
        lie = self.lie.get((nodes[0] - 1) // 3)
        if lie == "weight":  # claims ten times the examples its rows account for
            agg = aggregate.MeanState(agg.total * 10, agg.weight * 10, agg.count)
        elif lie == "huge":  # a sum whose mean no bounded device update could give
            agg = aggregate.MeanState(agg.total * 1e6, agg.weight, agg.count)
        elif lie == "count":  # one more update folded than rows say
            agg = aggregate.MeanState(agg.total, agg.weight, agg.count + 1)
        elif lie == "stray":  # a row for a device it was never asked about
            rows.append(ClientRecord(client="99", outcome=ClientStatus.DROPPED))
        elif lie == "raise":
            raise RuntimeError("edge process died")
        return TrainOutcome(aggregate=agg, clients=rows)


def _request(size: int, nodes: list[int]) -> TrainRequest:
    return TrainRequest(server_round=1, nodes=nodes, state=ServerState.initial(np.zeros(size, np.float32)),
                        config=TrainConfig(round=1, epochs=1, batch_size=1, lr=0.1, seed=1),
                        deadline_s=5.0, max_update_bytes=1 << 20)


class _Mean(MeanStrategy):
    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        return state.advanced(state.params + mean_delta)


@pytest.mark.parametrize("lie", ["weight", "huge", "count", "stray", "raise"])
def test_a_lying_edge_is_refused_and_the_others_are_merged(lie: str) -> None:
    # Three edges of three devices (1-3, 4-5-6, 7-8-9); edge 1 lies. Device n sends n x u with n examples.
    u = np.array([0.01, -0.02, 0.03], np.float32)
    tree = TreeTrain(_Edge(u, {1: lie}), edges=3, weighting=WeightPolicy("capped", max_examples=1000),
                     accumulate="float64")
    outcome = tree(_Grid(9), _request(3, list(range(1, 10))), _Mean())

    # the honest edges' devices 1,2,3,7,8,9: mean = sum n^2 u / sum n
    honest = [1, 2, 3, 7, 8, 9]
    expected = u.astype(np.float64) * sum(n * n for n in honest) / sum(honest)
    assert outcome.aggregate is not None and outcome.aggregate.count == 6
    np.testing.assert_allclose(aggregate.finalize(outcome.aggregate), expected, rtol=1e-6)
    by_client = {c.client: c for c in outcome.clients}
    assert sorted(by_client, key=int) == [str(n) for n in range(1, 10)]
    liars = [by_client[str(n)] for n in (4, 5, 6)]
    want = ClientStatus.FAILED if lie == "raise" else ClientStatus.REJECTED
    assert all(c.outcome == want and "edge 1" in (c.reason or "") for c in liars)
    assert all(by_client[str(n)].outcome == ClientStatus.OK for n in honest)
    row = outcome.tree["edges"][1]
    assert row["answered"] == 0 and "problem" in row


@pytest.mark.parametrize("accumulate", ["float32", "float64"])
def test_the_honest_tree_folds_every_edge(accumulate: str) -> None:
    u = np.array([0.01, -0.02, 0.03], np.float32)
    tree = TreeTrain(_Edge(u), edges=3, weighting=WeightPolicy("capped", max_examples=1000), accumulate=accumulate)
    outcome = tree(_Grid(9), _request(3, list(range(1, 10))), _Mean())
    assert outcome.aggregate.total.dtype == np.dtype(accumulate)  # [federation] accumulate: the merged sum's type
    expected = u.astype(np.float64) * sum(n * n for n in range(1, 10)) / 45
    np.testing.assert_allclose(aggregate.finalize(outcome.aggregate), expected, rtol=1e-6)
    # the train loss: device n reported loss n, weighted by its n examples: sum n^2 / sum n = 285 / 45
    assert outcome.train_loss == pytest.approx(285 / 45)
    assert [e["answered"] for e in outcome.tree["edges"]] == [3, 3, 3]


# ------------------------------------------------------------------ topology


@pytest.mark.parametrize(("devices", "edges"), [(12, 3), (10, 3), (7, 7), (10_000, 100), (5, 1)])
def test_blocks_split_devices_into_contiguous_edges_of_near_equal_size(devices: int, edges: int) -> None:
    topo = Topology.blocks(edges, range(devices, 0, -1))  # any order: sorted by id
    members = [topo.members(e) for e in range(edges)]
    assert sorted(d for m in members for d in m) == list(range(1, devices + 1))
    assert {len(m) for m in members} <= {devices // edges, devices // edges + 1}
    assert all(m == list(range(m[0], m[-1] + 1)) for m in members)  # contiguous
    assert all(topo.edge_of(d) == e for e, m in enumerate(members) for d in m)


def test_groups_leave_out_edges_with_nothing_sampled() -> None:
    topo = Topology.blocks(4, range(1, 9))
    assert topo.groups([8, 1, 2, 7]) == [(0, [1, 2]), (3, [8, 7])]


@pytest.mark.parametrize("edges", [0, 6, -1])
def test_a_topology_needs_between_one_edge_and_one_per_device(edges: int) -> None:
    with pytest.raises(ValueError, match="edges"):
        Topology.blocks(edges, range(1, 6))


@pytest.mark.parametrize("secagg", [False, True], ids=["plain", "secagg-inside-edges"])
def test_an_edge_that_vanishes_mid_round_counts_its_devices_dropped_and_the_run_goes_on(db_url: str,
                                                                                       secagg: bool) -> None:
    # Two edges of three devices; every round one of them vanishes after its devices trained
    sections: dict[str, Any] = {"federation": {**FED, "clients": 6, "min_clients": 3}, "faults": {"edges": 0.5},
                                "hierarchy": {"edges": 2}}
    if secagg:
        sections["secagg"] = {"enabled": True, "bits": 64, "clip_range": 4.0}
    summary = simulate(tiny_scenario(rounds=4, **sections), db_url=db_url, workers=1)

    # each round: 3 answered, 3 dropped (the lost edge's, with its reason), and the model learned from the rest
    assert summary.status == "finished", summary.error
    assert summary.clients is not None and (summary.clients["answered"], summary.clients["dropped"]) == (12, 12)
    store = RunStore(db_url)
    for r in store.rounds(summary.run_id):
        lost = [e for e in r.tree["edges"] if e.get("problem")]
        assert len(lost) == 1 and lost[0]["dropped"] == 3 and "vanished" in lost[0]["problem"]
        dropped = [c for c in store.client_results(summary.run_id, r.round) if c.outcome == "dropped"]
        assert {c.metrics[EDGE_METRIC] for c in dropped} == {lost[0]["edge"]} and len(dropped) == 3
        assert r.metrics["status"] == "ok"
    assert summary.final_accuracy > 0.5


def test_vanishing_edges_need_a_tree() -> None:
    with pytest.raises(ScenarioError, match=r"faults.edges = 0.5: makes edge aggregators vanish.*\[hierarchy\]"):
        tiny_scenario(faults={"edges": 0.5})


def test_federated_evaluation_through_the_edges_gives_the_flat_scores(db_url: str) -> None:
    # the tiny scenario evaluates on the devices every round; under a tree each edge asks its own and sends rows
    fed = {**FED, "clients_per_round": 9}
    flat = simulate(tiny_scenario(rounds=2, federation=fed), db_url=db_url, workers=1)
    tree = simulate(tiny_scenario(rounds=2, federation=fed, hierarchy={"edges": 3}), db_url=db_url, workers=1)
    store = RunStore(db_url)
    for r_flat, r_tree in zip(store.rounds(flat.run_id), store.rounds(tree.run_id), strict=True):
        assert r_tree.fed_loss is not None and r_tree.fed_accuracy is not None
        assert r_tree.fed_loss == pytest.approx(r_flat.fed_loss, abs=1e-6)
        assert r_tree.fed_accuracy == pytest.approx(r_flat.fed_accuracy, abs=1e-9)
        flat_rows = {c.client: c for c in store.client_results(flat.run_id, r_flat.round)}
        tree_rows = {c.client: c for c in store.client_results(tree.run_id, r_tree.round)}
        assert flat_rows.keys() == tree_rows.keys() and len(tree_rows) == 9
        for client, row in tree_rows.items():
            assert row.eval_accuracy == pytest.approx(flat_rows[client].eval_accuracy, abs=1e-9)
            assert row.metrics["eval-examples"] == flat_rows[client].metrics["eval-examples"]
        # the aggregator received one evaluation message per edge asked, each carrying its devices' rows
        assert r_tree.metrics["eval-bytes-in"] > 0


def test_an_edge_that_lies_about_a_devices_score_loses_its_evaluation_not_the_round() -> None:
    honest = eval_partial_reply({1: (0.5, 0.75, 10)}, {1: {"mae": 0.2}}, {1: (0.4, 30)},
                                {2: (ClientStatus.DROPPED, "gone")})
    rows = parse_eval_partial(honest, [1, 2])
    assert (rows.results[1].loss, rows.results[1].accuracy, rows.results[1].num_examples) == (0.5, 0.75, 10)
    assert rows.results[1].metrics == {"mae": 0.2} and rows.results[1].train_loss == 0.4
    assert rows.lost == {2: ("dropped", "gone")}
    for forged, why in (({1: (0.5, 1.5, 10)}, "accuracy"), ({3: (0.5, 0.5, 10)}, "no device it was asked about"),
                        ({1: (float("nan"), 0.5, 10)}, "loss")):
        with pytest.raises(UpdateRejected, match=why):
            parse_eval_partial(eval_partial_reply(forged, {}, {}, {}), [1, 2])
    with pytest.raises(UpdateRejected, match="twice"):
        parse_eval_partial(eval_partial_reply({1: (0.5, 0.5, 10)}, {}, {}, {1: ("dropped", "x")}), [1, 2])


def test_the_scenarios_accumulate_reaches_every_running_sum() -> None:
    for accumulate in ("float32", "float64"):
        fed = {**FED, "accumulate": accumulate}
        assert build_train(tiny_scenario(federation=fed)).accumulate == accumulate
        tree = build_train(tiny_scenario(federation=fed, hierarchy={"edges": 3}))
        assert isinstance(tree, TreeTrain) and tree.accumulate == tree.edge.accumulate == accumulate
        secure = build_train(tiny_scenario(federation=fed, secagg={"enabled": True}))
        assert secure.accumulate == accumulate


@pytest.mark.parametrize(("secagg", "adaptive"), [(False, False), (True, False), (False, True)],
                         ids=["plain", "secagg-inside-edges", "adaptive-clip"])
def test_central_dp_over_a_tree_releases_the_flat_runs_model_and_spends_the_same_epsilon(
        db_url: str, monkeypatch: pytest.MonkeyPatch, secagg: bool, adaptive: bool) -> None:
    # Arrange: DP-FedAvg, 12 devices sampled by Poisson (q = 6/12, or 1), central noise. Its sample and noise come from
    # a secret generator; the test replaces it with the same seeded sequence for both runs, so the flat run is
    # the independent reference for the very same cohorts and noise
    import itertools

    dp = {"enabled": True, "noise_multiplier": 0.5, "clip_norm": 0.5, "adaptive_clipping": adaptive}
    # under secure aggregation inside the edges every device is sampled (q = 1): a Poisson sample can leave an
    # edge one device, too few for its own secure sum, where the flat cohort has enough
    fed = {"clients": 12, "min_clients": 1, "weighting": "capped", "clients_per_round": 12 if secagg else 6}
    # a 64-bit ring: each cohort's quantisation grid then rounds below float32's own error (as above)
    extra: dict[str, Any] = {"secagg": {"enabled": True, "bits": 64, "clip_range": 4.0}} if secagg else {}

    def run(**tree: Any) -> Any:
        seeds = itertools.count(1000)
        monkeypatch.setattr("privacy.dp.strategy.secure_rng", lambda: np.random.default_rng(next(seeds)))
        return simulate(tiny_scenario(rounds=3, federation=fed, dp=dp, **extra, **tree), db_url=db_url, workers=1)

    # Execute
    flat, tree = run(), run(hierarchy={"edges": 3})

    # Assert: the same devices each round, the same released model (float32 sums in another order), the same
    # privacy spent; each edge's weight was checked as its count of devices (DP weighs every device 1)
    assert flat.status == tree.status == "finished", (tree.status, RunStore(db_url).get_run(tree.run_id).error)
    assert _sampled(db_url, flat.run_id) == _sampled(db_url, tree.run_id)
    a, b = _model(db_url, flat.run_id), _model(db_url, tree.run_id)
    assert np.abs(a - b).max() <= 1e-5 and np.abs(a).max() > 0.01
    store = RunStore(db_url)
    eps = [[r.epsilon for r in store.rounds(run.run_id)] for run in (flat, tree)]
    assert eps[0] == eps[1] and all(e is not None and e > 0 for e in eps[0])
    assert all(e["answered"] == e["sampled"] for r in store.rounds(tree.run_id) for e in r.tree["edges"])


def test_distributed_dp_over_a_tree_runs_with_secure_aggregation_inside_the_edges(db_url: str) -> None:
    # each device adds its noise share sized by the round's whole cohort (K = 12, not its edge's 4), and the
    # aggregator's top-up for missing shares counts the merged sum's devices: the same epsilon as flat
    dp = {"enabled": True, "noise_multiplier": 0.5, "clip_norm": 0.5, "placement": "distributed"}
    fed = {"clients": 12, "min_clients": 1, "weighting": "capped", "clients_per_round": 12}
    runs = [simulate(tiny_scenario(rounds=2, federation=fed, dp=dp, secagg={"enabled": True}, **tree),
                     db_url=db_url, workers=1) for tree in ({}, {"hierarchy": {"edges": 3}})]
    store = RunStore(db_url)
    assert [r.status for r in runs] == ["finished", "finished"]
    eps = [[r.epsilon for r in store.rounds(run.run_id)] for run in runs]
    assert eps[0] == eps[1] and eps[0][0] is not None
    assert all(e["answered"] == 4 for r in store.rounds(runs[1].run_id) for e in r.tree["edges"])
    assert runs[1].final_accuracy > 0.3  # noised, and still learning


def test_central_dp_with_a_secure_sum_across_the_edges_folds_it_as_dp_fedavg_folds_a_secure_sum(db_url: str) -> None:
    dp = {"enabled": True, "noise_multiplier": 0.5, "clip_norm": 0.5}
    fed = {"clients": 12, "min_clients": 1, "weighting": "capped", "clients_per_round": 12}
    run = simulate(tiny_scenario(rounds=2, federation=fed, dp=dp, secagg={"enabled": True},
                                 hierarchy={"edges": 3, "secure_across_edges": True}), db_url=db_url, workers=1)
    store = RunStore(db_url)
    assert run.status == "finished", store.get_run(run.run_id).error
    across = [r.tree["secure_across_edges"] for r in store.rounds(run.run_id)]
    assert all(a["edges"] == a["survivors"] == 3 for a in across)  # the aggregator saw only the global sum
    assert all(r.epsilon is not None and r.epsilon > 0 for r in store.rounds(run.run_id))


# ------------------------------------------------------------------ a robust rule at each edge


class _BufferEdge:
    """An edge workflow folding device n's update ``n x u`` (device 5: a Byzantine ``-1000 x u``) with the rule."""

    def __init__(self, update: np.ndarray) -> None:
        self.update = update

    def __call__(self, grid: Grid, request: TrainRequest, strategy: Strategy[Any]) -> TrainOutcome[Any]:  # noqa: ARG002
        agg = strategy.new_aggregate(self.update.size)
        for n in request.nodes:
            agg = strategy.accumulate(agg, self.update * (-1000.0 if n == 5 else float(n)), float(n))
        return TrainOutcome(aggregate=agg, clients=[ClientRecord(client=str(n), outcome=ClientStatus.OK,
                                                                  num_examples=n) for n in request.nodes])


def test_a_median_at_each_edge_outvotes_its_byzantine_device_and_fedavg_merges_the_edges() -> None:
    from aggregator.hierarchy.robust import EdgeRobust
    from aggregator.strategies.median import FedMedian

    # Three edges of three devices; device 5 (edge 1) sends -1000 u. Worked by hand, coordinate by coordinate:
    # edge 0 median(1u, 2u, 3u) = 2u; edge 1 median(4u, -1000u, 6u) = 4u; edge 2 median(7u, 8u, 9u) = 8u;
    # FedAvg over the edges, 3 devices each: (2 + 4 + 8) / 3 u
    u = np.array([0.01, -0.02, 0.03], np.float32)
    strategy = EdgeRobust(FedMedian())
    tree = TreeTrain(_BufferEdge(u), edges=3, weighting=WeightPolicy("capped", max_examples=1000), unit_weights=True)
    outcome = tree(_Grid(9), _request(3, list(range(1, 10))), strategy)

    assert outcome.aggregate is not None and (outcome.aggregate.weight, outcome.aggregate.count) == (9.0, 9)
    np.testing.assert_allclose(aggregate.finalize(outcome.aggregate), u * 14 / 3, rtol=1e-6)
    assert all(c.outcome == ClientStatus.OK for c in outcome.clients)
    # the step is the rule's own (server_lr 1): the model moves by the merged mean
    state = strategy.apply(ServerState.initial(np.zeros(3, np.float32)), aggregate.finalize(outcome.aggregate))
    np.testing.assert_allclose(state.params, u * 14 / 3, rtol=1e-6)
    assert strategy.name == "median@edges"


def test_an_edge_claiming_its_robust_aggregate_weighs_its_examples_is_refused() -> None:
    from aggregator.hierarchy.robust import EdgeRobust
    from aggregator.strategies.median import FedMedian

    class Inflating(_BufferEdge):
        def __call__(self, grid: Grid, request: TrainRequest, strategy: Strategy[Any]) -> TrainOutcome[Any]:
            out = super().__call__(grid, request, strategy)
            # as a plain sum weighted by example counts: 1 + 2 + 3 = 6, where each device weighs 1 under the rule
            if request.nodes[0] == 1:
                mean = strategy.finalize(out.aggregate, np.random.default_rng(0))
                out.aggregate = aggregate.MeanState(mean * 6, 6.0, 3)
            return out

    u = np.array([0.01, -0.02, 0.03], np.float32)
    tree = TreeTrain(Inflating(u), edges=3, weighting=WeightPolicy("capped", max_examples=1000), unit_weights=True)
    outcome = tree(_Grid(9), _request(3, list(range(1, 10))), EdgeRobust(FedMedian()))
    assert {c.client for c in outcome.clients if c.outcome == ClientStatus.REJECTED} == {"1", "2", "3"}
    np.testing.assert_allclose(aggregate.finalize(outcome.aggregate), u * 12 / 2, rtol=1e-6)  # (4 + 8) / 2


@pytest.mark.parametrize("rule", [{"name": "median"},
                                  {"name": "trimmed_mean", "trimmed_mean": {"trim_fraction": 0.25}}],
                         ids=["median", "trimmed_mean"])
def test_a_robust_rule_at_the_edges_learns_through_a_byzantine_attack(db_url: str, rule: dict[str, Any]) -> None:
    scenario = tiny_scenario(rounds=3, federation={"clients": 12, "min_clients": 1, "weighting": "capped"},
                             strategy=rule, hierarchy={"edges": 3},
                             faults={"byzantine": {"fraction": 0.17, "attack": "signflip"}})
    run = simulate(scenario, db_url=db_url, workers=1)
    stored = RunStore(db_url).get_run(run.run_id)
    assert run.status in ("finished", "degraded") and run.final_accuracy > 0.6, (run.status, stored.error)
    assert stored.strategy == f"{rule['name']}@edges"
    assert all(e["answered"] == 4 for r in RunStore(db_url).rounds(run.run_id) for e in r.tree["edges"])


def test_a_tree_run_stopped_after_round_2_resumes_to_the_uninterrupted_model(db_url: str) -> None:
    # Arrange: a tree of 3 edges with secure aggregation inside them, FedAdam's server state carried across rounds
    scenario = tiny_scenario(rounds=4, federation={**FED, "clients_per_round": 8}, hierarchy={"edges": 3},
                             strategy={"name": "fedadam", "server_lr": 0.01})
    whole = simulate(scenario, db_url=db_url, workers=1)

    def crash_after_round_2(record: Any) -> None:
        if record.round == 2:
            raise KeyboardInterrupt  # the aggregator dies once round 2 is committed

    # Act: the same scenario, stopped after round 2 and resumed from the store
    with pytest.raises(KeyboardInterrupt):
        simulate(scenario, db_url=db_url, workers=1, on_round=crash_after_round_2)
    store = RunStore(db_url)
    stopped = next(r for r in store.list_runs() if r.id != whole.run_id)
    assert (stopped.status, stopped.rounds_done) == ("interrupted", 2)
    resumed = simulate(scenario, db_url=db_url, workers=1, resume_id=stopped.id)

    # Assert: every round's devices and the final model are the uninterrupted run's; no round twice
    assert resumed.status == "finished" and [r.round for r in store.rounds(stopped.id)] == [1, 2, 3, 4]
    assert _sampled(db_url, stopped.id) == _sampled(db_url, whole.run_id)
    np.testing.assert_array_equal(_model(db_url, stopped.id), _model(db_url, whole.run_id))
