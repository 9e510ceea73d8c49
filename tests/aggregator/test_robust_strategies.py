"""Robust aggregators on tiny inputs, against results worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from aggregator.rounds import _marked_clients as marked_clients
from aggregator.strategies import BufferedStrategy, CenteredClipping, FedMedian, FedTrimmedMean, Krum
from aggregator.strategies.centered_clipping import CCState
from core.buffer import UpdateBuffer, buffer_merge
from core.records import ClientRecord
from core.strategy import ServerState
from core.train import TrainOutcome
from privacy.dp.mechanisms import gaussian_noise
from privacy.dp.strategy import DPFedAvg

RNG = np.random.default_rng(0)


def vec(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def fold(strategy, updates, size: int, weights=None):
    agg = strategy.new_aggregate(size)
    for i, update in enumerate(updates):
        agg = strategy.accumulate(agg, vec(*update), 1 if weights is None else weights[i])
    return agg


def centred_on(strategy: CenteredClipping, momentum: np.ndarray) -> CenteredClipping:
    state = ServerState(params=np.zeros(momentum.size, np.float32), slots={"momentum": momentum})
    return strategy.for_round(state)


# ----------------------------------------------------------------- centered clipping


def test_centered_clipping_clips_each_difference_around_the_previous_momentum() -> None:
    # Prepare: v = (1, 0), tau = 1, no momentum, no buckets.
    # x1 = (4, 0):  x1 - v = (3, 0),  norm 3 -> clipped to (1, 0)
    # x2 = (1, .5): x2 - v = (0, .5), norm .5 -> kept
    # x3 = (1, -2): x3 - v = (0, -2), norm 2 -> clipped to (0, -1)
    # v' = v + ((1, 0) + (0, .5) + (0, -1)) / 3 = (4/3, -1/6)
    cc = centred_on(CenteredClipping(clip_radius=1.0, bucket_size=1, momentum=0.0), vec(1, 0))

    # Execute
    agg = fold(cc, [(4, 0), (1, 0.5), (1, -2)], 2)
    result = cc.finalize(agg, RNG)

    # Assert
    np.testing.assert_allclose(result, [4 / 3, -1 / 6], rtol=1e-6)
    assert agg.marks == {0: {"clipped": 1.0}, 2: {"clipped": 1.0}}


def test_centered_clipping_with_momentum_clips_the_client_momentum() -> None:
    # Prepare: beta = .5, v = (0, 2), tau = 1. Client momentum m = .5 x + .5 v, so
    # m - v = .5 (x - v):  x = (4, 2) -> (2, 0) -> clipped (1, 0);  x = (0, 3) -> (0, .5).
    # v' = (0, 2) + ((1, 0) + (0, .5)) / 2 = (.5, 2.25)
    cc = centred_on(CenteredClipping(clip_radius=1.0, bucket_size=1, momentum=0.5), vec(0, 2))

    # Execute
    result = cc.finalize(fold(cc, [(4, 2), (0, 3)], 2), RNG)

    # Assert
    np.testing.assert_allclose(result, [0.5, 2.25], rtol=1e-6)


def test_bucketing_averages_consecutive_arrivals_before_clipping() -> None:
    # Prepare: v = 0, tau = 1, s = 2. Bucket 1 = mean((2, 0), (0, 0)) = (1, 0): norm 1, kept.
    # Bucket 2 (short, closed by finalize) = (0, 4) -> clipped (0, 1). v' = ((1, 0) + (0, 1)) / 2
    cc = CenteredClipping(clip_radius=1.0, bucket_size=2, momentum=0.0)

    # Execute
    agg = fold(cc, [(2, 0), (0, 0), (0, 4)], 2)
    result = cc.finalize(agg, RNG)

    # Assert
    np.testing.assert_allclose(result, [0.5, 0.5])
    assert agg.marks == {2: {"clipped": 1.0}}
    assert agg.buckets == 1 and agg.count == 3  # finalize closed the short bucket on a copy


def test_a_clipped_bucket_marks_every_member() -> None:
    # Prepare: v = 0, tau = 1, s = 2: mean((4, 0), (0, 0)) = (2, 0) is clipped
    cc = CenteredClipping(clip_radius=1.0, bucket_size=2, momentum=0.0)

    # Execute
    agg = fold(cc, [(4, 0), (0, 0)], 2)

    # Assert
    assert agg.marks == {0: {"clipped": 1.0}, 1: {"clipped": 1.0}}
    np.testing.assert_allclose(cc.finalize(agg, RNG), [1.0, 0.0])


def test_centered_clipping_ignores_reported_example_counts() -> None:
    # Prepare
    cc = CenteredClipping(clip_radius=10.0, bucket_size=1, momentum=0.0)

    # Execute: a count of 10^9 weighs what a count of 1 does
    inflated = cc.finalize(fold(cc, [(1, 0), (0, 1)], 2, weights=[10**9, 1]), RNG)

    # Assert
    np.testing.assert_allclose(inflated, [0.5, 0.5])


def test_centered_clipping_state_is_a_streaming_fold_of_fixed_size() -> None:
    # Prepare
    cc = CenteredClipping(clip_radius=1.0, bucket_size=3, momentum=0.9)

    # Execute: many updates, one pass
    agg = fold(cc, [tuple(RNG.normal(size=4)) for _ in range(50)], 4)

    # Assert: three model-sized buffers whatever the number of clients, and no list of updates
    assert isinstance(agg, CCState) and agg.count == 50
    arrays = [v for v in vars(agg).values() if isinstance(v, np.ndarray)]
    assert len(arrays) == 3 and all(a.shape == (4,) for a in arrays)
    assert not getattr(CenteredClipping, "needs_all_updates", False)


def test_apply_steps_by_the_new_momentum_and_keeps_it_as_the_next_centre() -> None:
    # Prepare
    cc = CenteredClipping(clip_radius=1.0, bucket_size=1, momentum=0.0, server_lr=0.5)
    state = ServerState.initial(vec(1, 1))

    # Execute
    new = cc.apply(state, vec(2, 0))
    bound = cc.for_round(new)

    # Assert: x = (1, 1) + .5 (2, 0); the centre of the next round is (2, 0)
    np.testing.assert_allclose(new.params, [2, 1])
    np.testing.assert_allclose(bound.new_aggregate(2).center, [2, 0])


def test_centered_clipping_under_central_dp_clips_each_term_twice_and_noises_the_sum() -> None:
    # Prepare: CC tau = 1, beta = .5, centre v = (1, 0); DP C = .4, z = 1, m = 2.
    # x1 = (5, 0):   .5 (x1 - v) = (2, 0)    -> CC clip (1, 0)  -> DP clip (.4, 0)
    # x2 = (1, .6):  .5 (x2 - v) = (0, .3)   -> kept            -> kept (.3 < .4)
    # sum (.4, .3) + N(0, (z C)^2) noise; v' = v + sum / m; x' = x + server_lr v'
    cc = CenteredClipping(clip_radius=1.0, bucket_size=1, momentum=0.5, server_lr=1.0)
    dp = DPFedAvg(cc, clip_norm=0.4, noise_multiplier=1.0, expected_clients=2, population=4, delta=1e-5)
    start = dp.fresh_state(vec(0, 0))
    state = replace(start, slots={"momentum": vec(1, 0)})
    noise = gaussian_noise(2, 0.4, np.random.default_rng(7))

    # Execute
    bound = dp.for_round(state)
    agg = fold(bound, [(5, 0), (1, 0.6)], 2, weights=[10**6, 1])  # counts are ignored
    new = bound.apply(state, bound.finalize(agg, np.random.default_rng(7)))

    # Assert
    expected_v = vec(1, 0) + (vec(0.4, 0.3) + noise) / 2
    np.testing.assert_allclose(new.slots["momentum"], expected_v, rtol=1e-5)
    np.testing.assert_allclose(new.params, expected_v, rtol=1e-5)
    assert bound.epsilon(new) > 0  # the round was accounted


def test_one_client_moves_the_dp_centered_clipping_release_by_at_most_min_tau_c_over_m() -> None:
    # Prepare: the same round with and without an attacker's huge update, noise-free (same rng)
    cc = CenteredClipping(clip_radius=0.3, bucket_size=1, momentum=0.0)
    dp = DPFedAvg(cc, clip_norm=1.0, noise_multiplier=1.0, expected_clients=4, population=8, delta=1e-5)
    state = replace(dp.fresh_state(vec(0, 0, 0)), slots={"momentum": vec(0.1, 0.2, 0.3)})
    honest = [(0.2, 0.1, 0.3), (0.0, 0.4, 0.2), (0.3, 0.3, 0.3)]

    # Execute
    bound = dp.for_round(state)
    without = bound.finalize(fold(bound, honest, 3), np.random.default_rng(1))
    with_attacker = bound.finalize(fold(bound, [*honest, (1e6, -1e6, 1e6)], 3), np.random.default_rng(1))

    # Assert: the model part moves by tau / m = .3 / 4 at most (C = 1 is looser)
    shift = float(np.linalg.norm(with_attacker[:3] - without[:3]))
    assert 0.07 < shift <= 0.3 / 4 + 1e-6


@pytest.mark.parametrize(("key", "value"), [("clip_radius", 0.0), ("bucket_size", 0), ("momentum", 1.0)])
def test_centered_clipping_refuses_bad_settings(key: str, value: float) -> None:
    with pytest.raises(ValueError, match=key):
        CenteredClipping(**{key: value})


# ----------------------------------------------------------------- rules that hold every update


def test_median_is_coordinate_wise() -> None:
    # Prepare: columns (1, 2, 10) and (5, -1, 0): medians 2 and 0
    median = FedMedian()

    # Execute
    agg = fold(median, [(1, 5), (2, -1), (10, 0)], 2)

    # Assert
    assert isinstance(agg, UpdateBuffer) and agg.count == 3
    np.testing.assert_allclose(median.finalize(agg, RNG), [2, 0])


def test_median_of_an_even_count_averages_the_middle_pair() -> None:
    median = FedMedian()
    np.testing.assert_allclose(median.finalize(fold(median, [(1,), (3,), (100,), (-50,)], 1), RNG), [2])


def test_trimmed_mean_cuts_the_extremes_of_each_coordinate() -> None:
    # Prepare: beta = .25 of 4 updates cuts 1 at each end: mean(2, 3) = 2.5; column 2: mean(0, 0)
    trimmed = FedTrimmedMean(beta=0.25)

    # Execute
    agg = fold(trimmed, [(1, 0), (2, 0), (3, 9), (100, -9)], 2)
    result = trimmed.finalize(agg, RNG)

    # Assert: client 0 is cut in column 1 only (half its coordinates), client 3 in both
    np.testing.assert_allclose(result, [2.5, 0.0])
    assert agg.marks[3] == {"trimmed": 1.0} and agg.marks[0] == {"trimmed": 0.5}


def test_krum_keeps_the_update_closest_to_its_neighbours() -> None:
    # Prepare: f = 1, n = 5: score = sum of squared distances to the n - f - 2 = 2 nearest.
    # 0: 1 + 9 = 10;  1: 1 + 4 = 5;  3: 4 + 9 = 13;  10: 49 + 81 = 130;  100: 8100 + 9409
    krum = Krum(num_byzantine=1)

    # Execute
    agg = fold(krum, [(0,), (1,), (3,), (10,), (100,)], 1)
    result = krum.finalize(agg, RNG)

    # Assert
    np.testing.assert_allclose(result, [1.0])
    assert sorted(agg.marks) == [0, 2, 3, 4] and agg.marks[4] == {"rejected": 1.0}


def test_multi_krum_averages_the_m_best_scored() -> None:
    # Prepare: same scores as above; m = 3 keeps 1, 0 and 3: mean 4/3
    krum = Krum(num_byzantine=1, num_selected=3)

    # Execute
    agg = fold(krum, [(0,), (1,), (3,), (10,), (100,)], 1)

    # Assert
    np.testing.assert_allclose(krum.finalize(agg, RNG), [4 / 3], rtol=1e-6)
    assert sorted(agg.marks) == [3, 4]


def test_buffered_rules_say_so_in_their_type_and_ignore_weights() -> None:
    # Prepare
    median = FedMedian()

    # Execute
    inflated = median.finalize(fold(median, [(0,), (1,), (2,)], 1, weights=[1, 1, 10**9]), RNG)

    # Assert
    assert issubclass(FedMedian, BufferedStrategy) and FedMedian.needs_all_updates
    assert Krum.needs_all_updates and FedTrimmedMean.needs_all_updates
    np.testing.assert_allclose(inflated, [1.0])


def test_buffered_state_merges_and_refuses_bad_updates() -> None:
    # Prepare
    median = FedMedian()
    a, b = fold(median, [(1,)], 1), fold(median, [(5,), (3,)], 1)

    # Execute
    merged = buffer_merge(a, b)

    # Assert
    assert merged.count == 3
    np.testing.assert_allclose(median.finalize(merged, RNG), [3])
    with pytest.raises(Exception, match="NaN"):
        median.accumulate(merged, vec(np.nan), 1)


def test_buffered_rules_copy_the_update_they_keep() -> None:
    median = FedMedian()
    update = vec(1, 2)
    agg = median.accumulate(median.new_aggregate(2), update, 1)
    update[:] = 99
    np.testing.assert_allclose(agg.updates[0], [1, 2])


# ----------------------------------------------------------------- marks reach the client records


def test_marks_go_to_the_records_of_the_updates_folded_in_arrival_order() -> None:
    # Prepare: the second folded update (third record: one rejected in between) was clipped
    agg = CenteredClipping(clip_radius=1.0, bucket_size=1, momentum=0.0).new_aggregate(1)
    agg.marks[1] = {"clipped": 1.0}
    clients = [ClientRecord("1", "ok", metrics={"train-loss": 0.5}), ClientRecord("2", "rejected"),
               ClientRecord("3", "ok"), ClientRecord("4", "dropped")]

    # Execute
    records = marked_clients(TrainOutcome(aggregate=agg, clients=clients))

    # Assert
    assert [r.metrics for r in records] == [{"train-loss": 0.5}, None, {"clipped": 1.0}, None]


def test_the_plain_mean_marks_nothing() -> None:
    from core.aggregate import empty

    clients = [ClientRecord("1", "ok")]
    assert marked_clients(TrainOutcome(aggregate=empty(2), clients=clients)) == clients
