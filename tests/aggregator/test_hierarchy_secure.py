"""What each level of a tree learns (issue #49): the aggregator, trying to read one edge's sum, fails only when
the sum across the edges is secured.

The attacker is the aggregator: it holds every message it received and the
protocol's own quantiser, and estimates edge 0's mean update from them. Its
positive control is the same attack on a tree without ``secure_across_edges``,
where the estimate is exact. The truth (each edge's sum) is captured inside
the edges, where only the edge holds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aggregator.hierarchy.tree as tree_module
from aggregator.hierarchy.edge import EdgeAnswer
from core.aggregate import MeanState
from core.partials import parse_partial_reply
from privacy.secagg.messages import MaskedInput
from privacy.secagg.quantize import Quantizer
from privacy.secagg.server import ServerRound
from runstore.store import RunStore
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario

FED = {"clients": 12, "min_clients": 1, "weighting": "capped", "accumulate": "float64"}
SECAGG = {"enabled": True, "bits": 64, "clip_range": 4.0}


class _Views:
    """What the edges held (the truth) and what the aggregator received, by round."""

    def __init__(self) -> None:
        self.truth: dict[tuple[int, int], np.ndarray] = {}  # (round, edge) -> the edge's mean update
        self.replies: dict[tuple[int, int], Any] = {}  # (round, edge) -> its reply, as the aggregator got it
        self.masked: list[np.ndarray] = []  # every masked input the aggregator received, in order


@pytest.fixture
def views(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Views]:
    seen = _Views()
    real_round = tree_module.edge_round

    def edge_round(grid: Any, instruction: Any, request: Any, train: Any, strategy: Any) -> EdgeAnswer:
        answer = real_round(grid, instruction, request, train, strategy)
        edge = (int(instruction["edge"]["devices"][0]) - 1) // 4  # 4 devices an edge: 1-4, 5-8, 9-12
        key = (request.server_round, edge)
        seen.replies[key] = answer.reply
        if answer.secret is not None:
            seen.truth[key] = np.asarray(answer.secret.total, np.float64) / answer.secret.weight
        else:
            partial = parse_partial_reply(answer.reply, 650, 1 << 20, list(instruction["edge"]["devices"]))
            assert partial.total is not None
            seen.truth[key] = partial.total.astype(np.float64) / partial.weight
        return answer

    real_accept = ServerRound.accept

    def accept(self: ServerRound, node: int, reply: Any) -> None:
        # the protocol across the 3 edges (each edge's own round has its 4 devices)
        if isinstance(reply, MaskedInput) and self.quantizer.participants == 3:
            seen.masked.append(reply.vector.copy())
        real_accept(self, node, reply)

    monkeypatch.setattr(tree_module, "edge_round", edge_round)
    monkeypatch.setattr(ServerRound, "accept", accept)
    yield seen


def _attack(views: _Views, server_round: int) -> np.ndarray:
    """The aggregator's best estimate of edge 0's mean update from what it received in ``server_round``."""
    reply = views.replies[(server_round, 0)]
    if "partial" in reply:  # the edge's sum, in clear
        partial = parse_partial_reply(reply, 650, 1 << 20, [1, 2, 3, 4])
        assert partial.total is not None
        return partial.total.astype(np.float64) / partial.weight
    # only a masked input: read it with the protocol's own quantiser, as if it were unmasked
    masked = views.masked[3 * (server_round - 1)]  # edges enter in order: edge 0's is each round's first
    values, weight = Quantizer(64, 4.0, 3).decode(masked)
    return values / weight if weight else values


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def _relative_error(estimate: np.ndarray, truth: np.ndarray) -> float:
    return float(np.linalg.norm(estimate - truth) / np.linalg.norm(truth))


def test_without_a_secure_sum_across_edges_the_aggregator_reads_each_edges_sum(views: _Views,
                                                                                db_url: str) -> None:
    # the positive control: secure aggregation inside each edge only
    summary = simulate(tiny_scenario(rounds=2, federation=FED, secagg=SECAGG, hierarchy={"edges": 3}),
                       db_url=db_url, workers=1)
    assert summary.status == "finished"
    for server_round in (1, 2):
        estimate, truth = _attack(views, server_round), views.truth[(server_round, 0)]
        assert _relative_error(estimate, truth) < 1e-6 and _cosine(estimate, truth) > 0.999999


def test_with_a_secure_sum_across_edges_the_aggregator_learns_only_the_global_sum(views: _Views,
                                                                                   db_url: str) -> None:
    flat = simulate(tiny_scenario(rounds=2, federation=FED), db_url=db_url, workers=1)
    tree = simulate(tiny_scenario(rounds=2, federation=FED, secagg=SECAGG,
                                  hierarchy={"edges": 3, "secure_across_edges": True}), db_url=db_url, workers=1)

    # the edges' replies carry no sum, and the attack on edge 0's masked input tells nothing: it is further from
    # the truth than guessing zero (relative error 1), and points nowhere near it (a random direction in 650
    # dimensions has |cosine| about 0.04)
    assert tree.status == "finished"
    assert all("partial" not in reply for reply in views.replies.values())
    for server_round in (1, 2):
        estimate, truth = _attack(views, server_round), views.truth[(server_round, 0)]
        assert _relative_error(estimate, truth) > 1.0
        assert abs(_cosine(estimate, truth)) < 0.3
    # yet what it unmasked is the global sum: the flat model, within the 64-bit ring's rounding
    store = RunStore(db_url)
    a, b = store.load_state(flat.run_id), store.load_state(tree.run_id)
    assert a is not None and b is not None
    assert np.abs(a.params - b.params).max() <= 1e-6 and np.abs(a.params).max() > 0.05
    secure = store.rounds(tree.run_id)[-1].tree["secure_across_edges"]
    assert secure["edges"] == secure["survivors"] == 3 and secure["error_bound"] < 1e-9


def test_an_edge_whose_protocol_weight_is_not_its_declared_one_costs_the_round(monkeypatch: pytest.MonkeyPatch,
                                                                               db_url: str) -> None:
    real_round = tree_module.edge_round

    def lying(grid: Any, instruction: Any, request: Any, train: Any, strategy: Any) -> EdgeAnswer:
        answer = real_round(grid, instruction, request, train, strategy)
        if answer.secret is not None and instruction["edge"]["devices"][0] == 5:  # edge 1 inflates its share
            s = answer.secret
            return EdgeAnswer(answer.reply, MeanState(s.total * 10, s.weight * 10, s.count))
        return answer

    monkeypatch.setattr(tree_module, "edge_round", lying)
    summary = simulate(tiny_scenario(rounds=1, federation=FED, secagg=SECAGG,
                                     hierarchy={"edges": 3, "secure_across_edges": True}), db_url=db_url, workers=1)

    # the sum cannot say which edge lied: every secured device's update is refused, the model is untouched
    store = RunStore(db_url)
    rows = store.client_results(summary.run_id, 1)
    assert {c.outcome for c in rows} == {"rejected"}
    assert all("is not the" in (c.reason or "") and "the edges declared" in (c.reason or "") for c in rows)
    assert summary.status == "failed"
