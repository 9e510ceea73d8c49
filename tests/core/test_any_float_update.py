"""A Flower reply's tensors in any float dtype and either memory order are read once as C-ordered float32.

scikit-learn's ``LogisticRegression.coef_`` is Fortran-ordered float64, and a
stock quickstart-sklearn client sends it as it is (issue 33, item 1).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from core.errors import UpdateRejected
from core.layouts import ParamLayout
from core.replies import decode_flat, parse_train_reply
from core.wire import wire_bytes

LIMIT = 10**7


def _reply(*arrays: np.ndarray) -> RecordDict:
    """A Flower ClientApp's train reply, as the stock examples build it: ``ArrayRecord(list_of_ndarrays)``."""
    return RecordDict({"arrays": ArrayRecord(list(arrays)), "metrics": MetricRecord({"num-examples": 5})})


def _parse(content: RecordDict, *shapes: tuple[int, ...]) -> np.ndarray:
    layout = ParamLayout.of({str(i): s for i, s in enumerate(shapes)})
    return parse_train_reply(content, layout.size, LIMIT, reference=np.zeros(layout.size, np.float32),
                             layout=layout).delta


@settings(max_examples=120, deadline=None)
@given(st.sampled_from([np.float16, np.float32, np.float64]), st.sampled_from(["C", "F"]),
       hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=5), st.data())
def test_any_float_dtype_in_either_order_is_read_as_c_ordered_float32(dtype: type, order: str,
                                                                       shape: tuple[int, ...],
                                                                       data: st.DataObject) -> None:
    # Prepare: values every float width holds exactly enough, laid out in the order asked
    values = data.draw(hnp.arrays(dtype, shape, elements=st.floats(-1e3, 1e3, width=16)))
    tensor = np.asarray(values, order=order)

    # Execute
    content = _reply(tensor)
    delta = _parse(content, shape)

    # Assert: the same numbers, in C order, as float32; the received bytes are the payload's own
    assert delta.dtype == np.float32 and delta.flags.c_contiguous
    np.testing.assert_array_equal(delta, tensor.astype(np.float32).reshape(-1))
    assert wire_bytes(content) >= tensor.nbytes


def test_a_fitted_logistic_regressions_coef_is_accepted_as_a_reply() -> None:
    # Prepare: quickstart-sklearn's model after local training: coef_ is Fortran-ordered float64
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    x, y = load_iris(return_X_y=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_iter=1, as the example trains: it never converges
        model = LogisticRegression(max_iter=1).fit(x, y)
    assert model.coef_.flags.f_contiguous and not model.coef_.flags.c_contiguous
    assert model.coef_.dtype == np.float64

    # Execute
    delta = _parse(_reply(model.coef_, model.intercept_), (3, 4), (3,))

    # Assert: row-major coef_ then intercept_, in float32
    expected = np.concatenate([model.coef_.reshape(-1), model.intercept_]).astype(np.float32)
    np.testing.assert_array_equal(delta, expected)


@pytest.mark.parametrize(("tensor", "shape", "reason"), [
    (np.full((2, 3), -(2**24) - 1, np.int64, order="F"), (2, 3), "int64 with a value beyond 2\\^24"),
    (np.ones((2, 3), np.complex64), (2, 3), "complex64 data, expected floats or integers"),
    (np.ones((2, 3), np.bool_), (2, 3), "bool data, expected floats or integers"),
    (np.ones((3, 2), np.float64, order="F"), (2, 3), r"has shape \(3, 2\), expected \(2, 3\)"),
    (np.asfortranarray([[1.0, np.nan], [0.0, 1.0]]), (2, 2), "NaN or Inf"),
    (np.full((2, 2), 1e300, np.float64, order="F"), (2, 2), "NaN or Inf"),  # beyond float32: an infinity
], ids=["integers-beyond-2^24", "complex", "bool", "wrong-shape", "nan", "beyond-float32"])
def test_non_floats_wrong_shapes_and_non_finite_values_are_still_refused(tensor: np.ndarray, shape: tuple,
                                                                         reason: str) -> None:
    with pytest.raises(UpdateRejected, match=reason):
        _parse(_reply(tensor), shape)


def test_integer_tensors_join_as_exact_floats() -> None:
    # a BatchNorm's num_batches_tracked (int64), Fortran order too, up to 2^24 either way
    tensor = np.asfortranarray(np.array([[0, 2**24], [-(2**24), 5]], np.int64))
    delta = _parse(_reply(tensor), (2, 2))
    np.testing.assert_array_equal(delta, np.array([0, 2**24, -(2**24), 5], np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_quorums_flat_delta_in_another_float_width_is_converted_once(dtype: type) -> None:
    # Execute
    vector = decode_flat(Array(np.arange(4, dtype=dtype)), 4)

    # Assert
    assert vector.dtype == np.float32
    np.testing.assert_array_equal(vector, [0.0, 1.0, 2.0, 3.0])
