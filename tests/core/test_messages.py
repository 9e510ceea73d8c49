"""Messages: what travels, and how a malformed reply is refused."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from core.errors import UpdateRejected
from core.eval_replies import eval_reply, parse_eval_reply
from core.instructions import TrainConfig, parse_instruction, train_instruction
from core.replies import decode_flat, parse_train_reply, train_reply


def test_instruction_round_trip() -> None:
    config = TrainConfig(round=2, epochs=1, batch_size=8, lr=0.1, seed=5, proximal_mu=0.5,
                         settings={"dp-clip": 1.0})
    params, back = parse_instruction(train_instruction(np.arange(3, dtype=np.float32), config))
    np.testing.assert_array_equal(params, [0, 1, 2])
    assert back == config


def test_decode_is_zero_copy_and_exact() -> None:
    vector = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    array = Array(vector)
    decoded = decode_flat(array, 1000, 10**6)
    np.testing.assert_array_equal(decoded, vector)
    assert not decoded.flags.owndata  # a view on the message bytes


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (train_reply(np.ones(3, np.float32), 5, {}), r"shape is \(3,\), expected \(4,\)"),
        (train_reply(np.full(4, np.inf, np.float32), 5, {}), "NaN or Inf"),
        (train_reply(np.ones(4, np.float32), -1, {}), r"num-examples must be an integer in \[1, 1000000000\]"),
        (RecordDict({"update": ArrayRecord({"delta": Array(np.ones(4, np.int32))}),
                     "metrics": MetricRecord({"num-examples": 3})}), "int32"),  # float64 is converted: core/layouts
        (RecordDict({"metrics": MetricRecord({"num-examples": 3})}), "no 'update'/'delta'"),
        (RecordDict({"update": ArrayRecord({"delta": Array(np.ones(4, np.float32))})}), "no 'metrics'"),
        (RecordDict({"update": ArrayRecord({"delta": Array(dtype="float32", shape=(4,), stype="numpy.ndarray",
                                                           data=b"junk")}),
                     "metrics": MetricRecord({"num-examples": 3})}), "not a valid .npy buffer"),
    ],
)
def test_malformed_reply_is_rejected_with_reason(content: RecordDict, reason: str) -> None:
    with pytest.raises(UpdateRejected, match=reason):
        parse_train_reply(content, 4, 10**6)


def test_oversized_reply_is_rejected_before_decoding() -> None:
    with pytest.raises(UpdateRejected, match="over the 100-byte limit"):
        parse_train_reply(train_reply(np.ones(400, np.float32), 1, {}), 400, 100)


def test_eval_reply_round_trip_and_rejects_nan() -> None:
    parsed = parse_eval_reply(eval_reply(0.5, 0.75, 10, 0.4, 90))
    assert (parsed.loss, parsed.accuracy, parsed.num_examples, parsed.train_loss) == (0.5, 0.75, 10, 0.4)
    with pytest.raises(UpdateRejected, match="out of range"):
        parse_eval_reply(eval_reply(float("nan"), 0.5, 10))
