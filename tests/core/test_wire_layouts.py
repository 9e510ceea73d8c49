"""The three reply layouts (Quorum, Flower's message API, Flower's legacy NumPyClient) and the one instruction."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from core.errors import UpdateRejected
from core.eval_replies import eval_reply, parse_eval_reply
from core.instructions import (
    TrainConfig,
    Wire,
    evaluate_instruction,
    parse_instruction,
    read_instruction,
    train_instruction,
)
from core.layouts import ParamLayout, npy_bytes
from core.replies import parse_train_reply, train_reply
from core.wire import content_bytes

LAYOUT = ParamLayout.of({"0.weight": (2, 3), "0.bias": (2,)})  # 8 values
GLOBAL = np.arange(8, dtype=np.float32)
CONFIG = TrainConfig(round=4, epochs=2, batch_size=8, lr=0.05, seed=7)


def state_dict(flat: np.ndarray, dtype: type = np.float32) -> dict[str, np.ndarray]:
    return {"0.weight": flat[:6].reshape(2, 3).astype(dtype), "0.bias": flat[6:].astype(dtype)}


def named(weights: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in weights.items()})


def flower_reply(weights: dict[str, np.ndarray], n: int = 10) -> RecordDict:
    arrays = named(weights)
    return RecordDict({"arrays": arrays, "metrics": MetricRecord({"train_loss": 0.25, "num-examples": n})})


def legacy_reply(weights: list[np.ndarray], n: int = 10, code: int = 0) -> RecordDict:
    tensors = {str(i): Array(data=npy_bytes(w), dtype="", stype="numpy.ndarray", shape=()) for i, w in
               enumerate(weights)}
    return RecordDict({"fitres.parameters": ArrayRecord(tensors),
                       "fitres.num_examples": MetricRecord({"num_examples": n}),
                       "fitres.metrics": ConfigRecord({"train_loss": 0.5}),
                       "fitres.status": ConfigRecord({"code": code, "message": "out of memory" if code else ""})})


def test_the_instruction_carries_the_model_once_as_a_state_dict_every_layout_reads() -> None:
    # Execute
    content = train_instruction(GLOBAL, CONFIG, LAYOUT)

    # Assert: named tensors of the layout's shapes (what Flower's to_torch_state_dict loads) ...
    arrays = content["arrays"]
    assert list(arrays) == ["0.weight", "0.bias"]
    np.testing.assert_array_equal(arrays["0.weight"].numpy(), GLOBAL[:6].reshape(2, 3))
    assert content["config"]["lr"] == 0.05 and content["config"]["server-round"] == 4
    assert content["config"]["local-epochs"] == 2
    # ... the legacy names alias the same records: Flower's content-addressed wire sends them once
    assert content["fitins.parameters"] is arrays and content["fitins.config"] is content["config"]
    assert len(content.children) == 2
    assert content_bytes(content) == GLOBAL.nbytes + 2 * 128  # the model, plus one .npy header per tensor
    # ... and Quorum's client reads it back exactly
    params, config = parse_instruction(content)
    np.testing.assert_array_equal(params, GLOBAL)
    assert config == CONFIG
    assert "evaluateins.parameters" in evaluate_instruction(GLOBAL, CONFIG, LAYOUT)


def test_a_flower_reply_becomes_a_delta_against_the_model_sent() -> None:
    # Prepare: a client moved every weight by +0.5 and answered full weights, as Flower's quickstart does
    content = flower_reply(state_dict(GLOBAL + 0.5))

    # Execute
    parsed = parse_train_reply(content, 8, 10**6, reference=GLOBAL, layout=LAYOUT)

    # Assert
    np.testing.assert_allclose(parsed.delta, np.full(8, 0.5, np.float32))
    assert parsed.delta.dtype == np.float32 and parsed.wire is Wire.FLOWER
    assert parsed.num_examples == 10 and parsed.metrics["train-loss"] == 0.25


def test_a_legacy_reply_in_float64_becomes_a_delta() -> None:
    weights = state_dict(GLOBAL - 1.0, np.float64)
    parsed = parse_train_reply(legacy_reply(list(weights.values()), n=7), 8, 10**6, reference=GLOBAL, layout=LAYOUT)
    np.testing.assert_allclose(parsed.delta, np.full(8, -1.0, np.float32))
    assert parsed.wire is Wire.LEGACY and parsed.num_examples == 7 and parsed.metrics["train-loss"] == 0.5


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (RecordDict({"weights": ConfigRecord({"w": [1.0]})}),
         r"no 'update'/'delta' array .*no 'arrays' .*no 'fitres.parameters' .*got \['weights'\]"),
        (flower_reply({"fc.weight": np.zeros((2, 3), np.float32), "0.bias": np.zeros(2, np.float32)}),
         r"unexpected: \['fc.weight'\]\); expected the model's state_dict: '0.weight' \(2, 3\), '0.bias' \(2,\)"),
        (flower_reply({"0.weight": np.zeros((3, 2), np.float32), "0.bias": np.zeros(2, np.float32)}),
         r"tensor '0.weight' has shape \(3, 2\), expected \(2, 3\)"),
        (flower_reply(state_dict(np.full(8, np.nan, np.float32))), "NaN or Inf"),
        (flower_reply(state_dict(GLOBAL), n=0), r"num-examples must be an integer"),
        (RecordDict({"arrays": named(state_dict(GLOBAL)), "metrics": ConfigRecord({"num-examples": 3})}),
         "'metrics' is a ConfigRecord, expected a MetricRecord"),
        (legacy_reply(list(state_dict(GLOBAL).values()), code=5), "legacy client reported status 5: out of memory"),
        (legacy_reply(list(state_dict(GLOBAL).values())[:1]), r"update has 1 tensors, expected"),
        (legacy_reply([np.zeros((2, 3), np.complex64), np.zeros(2, np.complex64)]), "complex64"),
    ],
)
def test_a_reply_that_fits_no_layout_is_rejected_with_the_reason(content: RecordDict, reason: str) -> None:
    with pytest.raises(UpdateRejected, match=reason):
        parse_train_reply(content, 8, 10**6, reference=GLOBAL, layout=LAYOUT)


def test_full_weights_are_refused_where_the_round_needs_more_than_the_model() -> None:
    # DP appends a clip bit to each update: only Quorum's client sends it
    with pytest.raises(UpdateRejected, match="this round takes 9 values per update"):
        parse_train_reply(flower_reply(state_dict(GLOBAL)), 9, 10**6, reference=GLOBAL, layout=LAYOUT)


def test_full_weights_over_the_byte_limit_are_refused_before_decoding() -> None:
    with pytest.raises(UpdateRejected, match="over the 16-byte limit"):
        parse_train_reply(flower_reply(state_dict(GLOBAL)), 8, 16, reference=GLOBAL, layout=LAYOUT)


def test_quorums_client_reads_flowers_fedavg_instruction_and_answers_in_its_layout() -> None:
    # Prepare: what flwr.serverapp.strategy.FedAvg sends (its own state dict order, its own config)
    content = RecordDict({"arrays": named({"0.bias": GLOBAL[6:], "0.weight": GLOBAL[:6].reshape(2, 3)}),
                          "config": ConfigRecord({"lr": 0.2, "server-round": 3})})

    # Execute
    instruction = read_instruction(content, LAYOUT, CONFIG)
    train = train_reply(np.ones(8, np.float32), 12, {"train-loss": 0.5, "duration-s": 1.0}, answer_to=instruction)
    evaluation = eval_reply(0.3, 0.9, 5, answer_to=instruction)

    # Assert: read by name into the client's order; Flower's settings win, the rest are the defaults
    np.testing.assert_array_equal(instruction.params, GLOBAL)
    assert instruction.wire is Wire.FLOWER
    assert (instruction.config.lr, instruction.config.round, instruction.config.epochs) == (0.2, 3, 2)
    # ... full weights under the server's names, one MetricRecord with Flower's keys
    np.testing.assert_array_equal(train["arrays"]["0.weight"].numpy(), GLOBAL[:6].reshape(2, 3) + 1)
    assert dict(train["metrics"]) == {"train_loss": 0.5, "num-examples": 12}
    assert dict(evaluation["metrics"]) == {"eval_loss": 0.3, "eval_acc": 0.9, "num-examples": 5}


def test_a_bad_flower_setting_is_named() -> None:
    content = RecordDict({"arrays": named(state_dict(GLOBAL)), "config": ConfigRecord({"lr": "fast"})})
    with pytest.raises(ValueError, match="config 'lr' = 'fast' is not a usable float"):
        read_instruction(content, LAYOUT, CONFIG)


def test_flower_and_legacy_eval_replies_are_read() -> None:
    flower = RecordDict({"metrics": MetricRecord({"eval_loss": 0.4, "eval_acc": 0.8, "num-examples": 20})})
    legacy = RecordDict({"evaluateres.loss": MetricRecord({"loss": 0.6}),
                         "evaluateres.num_examples": MetricRecord({"num_examples": 30}),
                         "evaluateres.metrics": ConfigRecord({"accuracy": 0.7}),
                         "evaluateres.status": ConfigRecord({"code": 0, "message": ""})})
    assert (parse_eval_reply(flower).loss, parse_eval_reply(flower).accuracy) == (0.4, 0.8)
    assert (parse_eval_reply(legacy).loss, parse_eval_reply(legacy).num_examples) == (0.6, 30)
    with pytest.raises(UpdateRejected, match="eval reply is in no known layout"):
        parse_eval_reply(RecordDict({"score": ConfigRecord({"x": 1})}))


def test_a_positional_flower_model_is_read_in_the_clients_order_and_answered_under_its_keys() -> None:
    # Prepare: a NumPy/scikit-learn app's server sends ArrayRecord([coef, intercept]): keys "0" and "1"
    content = RecordDict({"arrays": named({"0": GLOBAL[:6].reshape(2, 3), "1": GLOBAL[6:]}),
                          "config": ConfigRecord({"server-round": 1})})

    # Execute
    instruction = read_instruction(content, LAYOUT, CONFIG)
    train = train_reply(np.ones(8, np.float32), 4, {"train-loss": 0.1}, answer_to=instruction)

    # Assert: position k is the model's k-th tensor; the reply keeps the server's keys
    np.testing.assert_array_equal(instruction.params, GLOBAL)
    assert sorted(train["arrays"]) == ["0", "1"]
    np.testing.assert_array_equal(train["arrays"]["1"].numpy(), GLOBAL[6:] + 1)


def test_positional_arrays_of_the_wrong_shapes_or_count_are_refused() -> None:
    swapped = RecordDict({"arrays": named({"0": GLOBAL[6:], "1": GLOBAL[:6].reshape(2, 3)})})
    with pytest.raises(ValueError, match="shape"):
        read_instruction(swapped, LAYOUT, CONFIG)
    one = RecordDict({"arrays": named({"0": GLOBAL})})
    with pytest.raises(ValueError, match="lack"):
        read_instruction(one, LAYOUT, CONFIG)


def test_a_model_whose_own_tensors_are_named_by_number_is_read_by_name() -> None:
    # keys "0" and "1" that are the client model's own names are names, whatever their order in the record
    layout = ParamLayout.of({"0": (2, 3), "1": (2,)})
    content = RecordDict({"arrays": named({"1": GLOBAL[6:], "0": GLOBAL[:6].reshape(2, 3)})})
    instruction = read_instruction(content, layout, CONFIG)
    np.testing.assert_array_equal(instruction.params, GLOBAL)
    assert instruction.layout == layout
