"""End to end: the secure sum equals the plain float64 sum within the quantisation bound."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from privacy.secagg import SecAggAborted, SecAggConfig, Stage, secure_sum

N, D = 12, 40
# Parameters under which every dropout pattern below is survivable: a 50%
# dropout leaves >= t live members in every closed neighbourhood. Such low
# thresholds are no strict majority: only the semi-honest model allows them.
CONFIGS = {
    "complete": SecAggConfig(threshold=5, max_weight=4.0, threat_model="semi-honest"),
    "kregular": SecAggConfig(graph="kregular", degree=8, threshold=3, max_weight=4.0,
                             threat_model="semi-honest"),
}
# The default (malicious) model: majority thresholds t = 7 of 12 and 5 of 9.
MALICIOUS = {
    "complete": SecAggConfig(max_weight=4.0),
    "kregular": SecAggConfig(graph="kregular", degree=8, max_weight=4.0),
}
SEMI_HONEST_STAGES = [s for s in Stage if s is not Stage.CONSISTENCY_CHECK]


def entropy_from(label: bytes):
    counter = {"i": 0}

    def draw(n: int) -> bytes:
        counter["i"] += 1
        return hashlib.shake_256(label + counter["i"].to_bytes(8, "big")).digest(n)

    return draw


def inputs(n: int = N, d: int = D, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, d) for _ in range(n)], list(rng.uniform(0.5, 4.0, n))


def plain(vectors, weights, survivors):
    return sum(weights[i] * vectors[i] for i in survivors), sum(weights[i] for i in survivors)


@pytest.mark.parametrize("graph", sorted(CONFIGS))
@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5])
@pytest.mark.parametrize("stage", SEMI_HONEST_STAGES)
def test_secure_sum_matches_plain_sum_under_dropout(graph, fraction, stage):
    # Prepare
    vectors, weights = inputs()
    dropped = set(range(0, N, 4) if fraction == 0.25 else range(0, N, 2) if fraction == 0.5 else [])

    # Execute
    result = secure_sum(vectors, weights, CONFIGS[graph], dropouts={stage: dropped},
                        rng=np.random.default_rng(1))

    # Assert: clients that vanish at UNMASK are still in the sum.
    in_sum = set(range(N)) - (dropped if stage is not Stage.UNMASK else set())
    total, weight = plain(vectors, weights, in_sum)
    assert set(result.survivors) == in_sum
    assert np.abs(result.total - total).max() <= result.error_bound
    assert abs(result.total_weight - weight) <= result.error_bound
    done = {s.stage: len(s.completed) for s in result.stages}
    assert done[stage] == N - len(dropped)
    assert Stage.CONSISTENCY_CHECK not in done


@pytest.mark.parametrize("graph", sorted(MALICIOUS))
@pytest.mark.parametrize("stage", list(Stage))
def test_malicious_model_sum_matches_plain_sum_under_dropout(graph, stage):
    # Prepare: 25% drop at one stage; every closed neighbourhood keeps >= t.
    vectors, weights = inputs()
    dropped = {0, 4, 8}

    # Execute
    result = secure_sum(vectors, weights, MALICIOUS[graph], dropouts={stage: dropped},
                        rng=np.random.default_rng(1))

    # Assert: a client gone after MASKED_INPUT is still in the sum.
    late = stage in (Stage.CONSISTENCY_CHECK, Stage.UNMASK)
    in_sum = set(range(N)) - (set() if late else dropped)
    total, weight = plain(vectors, weights, in_sum)
    assert set(result.survivors) == in_sum
    assert np.abs(result.total - total).max() <= result.error_bound
    assert abs(result.total_weight - weight) <= result.error_bound
    done = {s.stage: len(s.completed) for s in result.stages}
    assert list(done) == list(Stage) and done[stage] == N - 3


def test_weighted_fedavg_equals_plain_fedavg():
    vectors, _ = inputs()
    examples = [10, 20, 35, 50, 64, 80, 100, 120, 7, 3, 90, 60]
    config = SecAggConfig(max_weight=120.0)

    result = secure_sum(vectors, examples, config, dropouts={Stage.MASKED_INPUT: {3, 7}},
                        rng=np.random.default_rng(2))

    total, weight = plain(vectors, examples, result.survivors)
    assert np.abs(result.mean - total / weight).max() <= 2.1 * result.error_bound / weight


def test_weights_above_the_cap_are_capped():
    vectors, _ = inputs(n=4)

    result = secure_sum(vectors, [1.0, 1.0, 9.0, 1.0], SecAggConfig(max_weight=2.0),
                        rng=np.random.default_rng(0))

    assert result.total_weight == pytest.approx(5.0, abs=result.error_bound)


def test_sixty_four_bit_ring_is_far_more_precise():
    vectors, weights = inputs()

    wide = secure_sum(vectors, weights, SecAggConfig(bits=64, max_weight=4.0), rng=np.random.default_rng(3))
    narrow = secure_sum(vectors, weights, SecAggConfig(max_weight=4.0), rng=np.random.default_rng(3))

    total, _ = plain(vectors, weights, range(N))
    assert np.abs(wide.total - total).max() <= wide.error_bound < narrow.error_bound / 1e6
    assert wide.stages[2].bytes_up == 2 * narrow.stages[2].bytes_up - N * 11


def test_sparse_default_graph_with_dropouts_at_every_stage():
    vectors, weights = inputs(n=30, d=20)
    dropouts = {Stage.ADVERTISE_KEYS: {1}, Stage.SHARE_KEYS: {5}, Stage.MASKED_INPUT: {9, 20}, Stage.UNMASK: {14}}

    result = secure_sum(vectors, weights, SecAggConfig(graph="kregular", max_weight=4.0),
                        dropouts=dropouts, rng=np.random.default_rng(4))

    total, _ = plain(vectors, weights, result.survivors)
    assert set(result.survivors) == set(range(30)) - {1, 5, 9, 20}
    assert np.abs(result.total - total).max() <= result.error_bound


def test_known_answer_with_injected_entropy():
    vectors, weights = inputs(n=5)
    runs = [secure_sum(vectors, weights, SecAggConfig(max_weight=4.0), rng=np.random.default_rng(5),
                       entropy=entropy_from(b"kat")) for _ in range(2)]

    assert np.array_equal(runs[0].total, runs[1].total)


@pytest.mark.parametrize("stage", list(Stage))
def test_round_fails_cleanly_below_threshold(stage):
    vectors, weights = inputs(n=6)

    with pytest.raises(SecAggAborted) as info:
        secure_sum(vectors, weights, SecAggConfig(threshold=4, max_weight=4.0),
                   dropouts={stage: {0, 2, 4}}, rng=np.random.default_rng(0))

    error = info.value
    assert (error.stage, error.survivors, error.threshold) == (stage, 3, 4)
    assert f"aborted at stage '{stage.value}': 3 of 6 sampled clients survived, threshold is 4" in str(error)


def test_sparse_neighbourhood_running_dry_names_the_client():
    vectors, weights = inputs(n=10)
    config = SecAggConfig(graph="kregular", degree=2, threshold=3, max_weight=4.0)

    with pytest.raises(SecAggAborted, match=r"stage 'masked_input'.*has 2 live share holders"):
        secure_sum(vectors, weights, config, dropouts={Stage.MASKED_INPUT: {0}},
                   rng=np.random.default_rng(0))


def test_stage_costs_are_recorded():
    vectors, weights = inputs(n=6, d=100)
    ticks = iter(range(10_000))

    result = secure_sum(vectors, weights, SecAggConfig(max_weight=4.0), rng=np.random.default_rng(0),
                        clock=lambda: float(next(ticks)))

    assert [s.stage for s in result.stages] == list(Stage)
    masked = result.stages[2]
    assert masked.bytes_up == 6 * (2 + 9 + 4 * 101)
    assert all(s.seconds >= s.server_seconds > 0 for s in result.stages)
    assert result.stages[0].bytes_down > 0


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="2 vectors but 3 weights"):
        secure_sum([np.zeros(3)] * 2, [1.0] * 3, SecAggConfig(), rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="same length"):
        secure_sum([np.zeros(3), np.zeros(4)], [1.0] * 2, SecAggConfig(), rng=np.random.default_rng(0))


def test_a_client_with_a_nan_update_drops_out():
    vectors, weights = inputs(n=5)
    vectors[2] = vectors[2].copy()
    vectors[2][0] = np.nan

    result = secure_sum(vectors, weights, SecAggConfig(threshold=2, max_weight=4.0, threat_model="semi-honest"),
                        rng=np.random.default_rng(0))

    assert 2 not in result.survivors
