"""The weighted-mean monoid, with numbers worked out by hand."""

import numpy as np
import pytest

from core import aggregate
from core.aggregate import step_problem
from core.errors import UpdateRejected


def vec(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_weighted_mean_by_hand() -> None:
    # Prepare: (1,2,3) with weight 1 and (3,2,1) with weight 3.
    state = aggregate.empty(3)
    # Execute
    state = aggregate.add(state, vec(1, 2, 3), 1)
    state = aggregate.add(state, vec(3, 2, 1), 3)
    # Assert: ((1+9)/4, (2+6)/4, (3+3)/4) = (2.5, 2.0, 1.5)
    np.testing.assert_allclose(aggregate.finalize(state), [2.5, 2.0, 1.5])
    assert state.weight == 4.0 and state.count == 2


def test_merge_equals_sequential_fold() -> None:
    a = aggregate.add(aggregate.add(aggregate.empty(2), vec(1, 0), 2), vec(0, 1), 1)
    b = aggregate.add(aggregate.empty(2), vec(4, 4), 1)
    merged = aggregate.merge(a, b)
    # (2*(1,0) + (0,1) + (4,4)) / 4 = (6/4, 5/4)
    np.testing.assert_allclose(aggregate.finalize(merged), [1.5, 1.25])
    assert merged.count == 3 and merged.weight == 4.0


def test_identity_element_merges_to_same() -> None:
    a = aggregate.add(aggregate.empty(2), vec(2, 4), 2)
    merged = aggregate.merge(aggregate.empty(2), a)
    np.testing.assert_array_equal(aggregate.finalize(merged), [2, 4])


def test_finalize_empty_is_an_error() -> None:
    with pytest.raises(ValueError, match="empty aggregate"):
        aggregate.finalize(aggregate.empty(3))


@pytest.mark.parametrize(
    ("update", "reason"),
    [
        (np.array([1, 2, 3], dtype=np.float64), "dtype is float64"),
        (vec(1, 2), r"shape is \(2,\)"),
        (vec(1, np.nan, 3), "NaN or Inf"),
        (vec(1, np.inf, 3), "NaN or Inf"),
        (np.ones((3, 1), dtype=np.float32), r"shape is \(3, 1\)"),
    ],
)
def test_bad_update_is_rejected_and_state_untouched(update: np.ndarray, reason: str) -> None:
    state = aggregate.add(aggregate.empty(3), vec(1, 1, 1), 1)
    with pytest.raises(UpdateRejected, match=reason):
        aggregate.add(state, update, 1)
    np.testing.assert_array_equal(state.total, [1, 1, 1])
    assert state.count == 1


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf")])
def test_bad_weight_is_rejected(weight: float) -> None:
    with pytest.raises(UpdateRejected, match="weight"):
        aggregate.add(aggregate.empty(2), vec(1, 1), weight)


def test_memory_is_one_model_whatever_the_number_of_updates() -> None:
    state = aggregate.empty(1000)
    state = aggregate.add(state, np.ones(1000, np.float32), 2.0)
    buffers = {id(state.total), id(state.scratch)}
    for _ in range(50):
        state = aggregate.add(state, np.ones(1000, np.float32), 2.0)
    assert {id(state.total), id(state.scratch)} == buffers
    np.testing.assert_allclose(aggregate.finalize(state), np.ones(1000))


def test_step_within_the_bound_is_accepted_and_beyond_it_refused() -> None:
    # Prepare: |before| = |(3, 4)| = 5, so with ratio 2 the bound is 10
    before = np.array([3.0, 4.0], dtype=np.float32)
    # Execute / Assert: a step (6, 8) has norm exactly 10
    assert step_problem(before, before + np.array([6.0, 8.0], np.float32), 2.0) is None
    problem = step_problem(before, before + np.array([6.5, 8.0], np.float32), 2.0)
    assert problem is not None and "over the bound 10" in problem


def test_non_finite_or_overflowing_step_is_refused() -> None:
    before = np.zeros(3, dtype=np.float32)  # |before| = 0: the bound is ratio x 1
    assert "NaN or Inf" in step_problem(before, np.array([0, np.inf, 0], np.float32), 10.0)
    assert "NaN or Inf" in step_problem(before, np.array([0, np.nan, 0], np.float32), 10.0)
    big = np.full(3, 3e38, dtype=np.float32)  # finite, but its norm overflows float32
    assert "over the bound" in step_problem(before, big, 10.0)


# ------------------------------------------------------------------ float64 accumulation ([federation] accumulate)


def test_float64_accumulation_keeps_what_float32_rounds_away() -> None:
    # 1 + 1e-8 is 1 in float32 (its spacing at 1 is 1.19e-7), so 10,000 such terms in float32 sum to 10,000
    # exactly, while the true sum is 10,000 + 1e-4, which float64 keeps
    ones = np.ones(2, np.float32)
    tiny = np.full(2, 1e-8, np.float32)
    wide, narrow = aggregate.empty(2, "float64"), aggregate.empty(2)
    for _ in range(10_000):
        wide = aggregate.add(aggregate.add(wide, ones, 1.0), tiny, 1.0)
        narrow = aggregate.add(aggregate.add(narrow, ones, 1.0), tiny, 1.0)
    assert narrow.total[0] == np.float32(10_000)
    assert wide.total.dtype == np.float64
    assert wide.total[0] == pytest.approx(10_000 + 1e-4, abs=1e-9)


def test_float64_weighted_add_merge_and_finalize() -> None:
    x, y = np.array([1.0, -2.0, 3.0], np.float32), np.array([0.5, 0.25, -1.0], np.float32)
    a = aggregate.add(aggregate.empty(3, "float64"), x, 3.0)
    b = aggregate.add(aggregate.empty(3, "float64"), y, 0.1)
    merged = aggregate.merge(a, b)
    expected = (3.0 * x.astype(np.float64) + 0.1 * y.astype(np.float64)) / 3.1
    mean = aggregate.finalize(merged)
    assert mean.dtype == np.float32 and merged.count == 2 and merged.weight == pytest.approx(3.1)
    np.testing.assert_allclose(mean, expected.astype(np.float32), rtol=1e-7)


def test_widened_makes_only_an_empty_state_float64() -> None:
    empty = aggregate.empty(4)
    assert aggregate.widened(empty, "float64").total.dtype == np.float64
    assert aggregate.widened(empty, "float32") is empty
    used = aggregate.add(aggregate.empty(4), np.ones(4, np.float32), 1.0)
    assert aggregate.widened(used, "float64") is used
    with pytest.raises(ValueError, match="dtype"):
        aggregate.empty(4, "float16")
