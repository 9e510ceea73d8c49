"""Client weights bounded by policy: worked out by hand."""

import pytest

from core.weighting import WeightPolicy


def test_median_cap_bounds_the_inflated_client_only() -> None:
    # Prepare: median of (80, 100, 120, 10**12) is (100 + 120) / 2 = 110, so the cap is 3 x 110 = 330
    counts = [100, 120, 80, 10**12]
    # Execute
    weights = WeightPolicy("median", median_cap=3.0).weights(counts)
    # Assert
    assert weights == [100.0, 120.0, 80.0, 330.0]
    assert weights[3] / sum(weights) == pytest.approx(330 / 630)  # no longer ~1.0


def test_capped_and_uniform_stream_one_reply_at_a_time() -> None:
    capped, uniform = WeightPolicy("capped", max_examples=150), WeightPolicy("uniform")
    assert capped.streams and uniform.streams and not WeightPolicy().streams
    assert [capped.weight(n) for n in (100, 150, 10**12)] == [100.0, 150.0, 150.0]
    assert uniform.weights([5, 10**12]) == [1.0, 1.0]


def test_honest_counts_under_the_cap_are_plain_fedavg_weights() -> None:
    assert WeightPolicy().weights([359, 360, 359, 359]) == [359.0, 360.0, 359.0, 359.0]
    assert WeightPolicy().weights([]) == []


def test_median_rule_has_no_streaming_weight() -> None:
    with pytest.raises(ValueError, match="whole round"):
        WeightPolicy("median").weight(10)
