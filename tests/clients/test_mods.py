"""The ClientApp's DP and compression mods (clients/mods.py), each on a handler's reply built here.

Numbers worked out by hand: an update of norm 5 clipped to 1 is the same
direction scaled by 1/5; top-k of 10% of 20 coordinates keeps the largest two.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import Mod

from clients.clientapp import client_mods
from clients.mods import DATA_VIEW_KEY, StatisticsMod, compression_mod, data_view, dp_mod, standardize_mod
from core.compress import Codec
from core.errors import UpdateRejected
from core.instructions import (
    STD_LIMIT,
    STD_MEAN,
    STD_PASS,
    STD_SCALES,
    STD_STD,
    Setting,
    SettingValue,
    TrainConfig,
    train_instruction,
)
from core.replies import own_update, train_reply
from learning.standardize import Standardization
from privacy.dp.mechanisms import ClientDPConfig
from privacy.secagg.flower_records import RECORD

DELTA = np.r_[3.0, 4.0, np.zeros(18)].astype(np.float32)  # norm 5

pytestmark = pytest.mark.usefixtures("task_identity")  # tests/clients/conftest.py: building a Message needs it


def _context() -> Context:
    return Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})


def _instruction(settings: dict[Setting, SettingValue], secure: bool = False) -> Message:
    config = TrainConfig(round=2, epochs=1, batch_size=8, lr=0.1, seed=3).with_settings(settings)
    content = train_instruction(np.zeros(20, np.float32), config)
    if secure:
        content[RECORD] = ConfigRecord({"stage": "setup"})
    return Message(content, dst_node_id=7, message_type="train")


class Handler:
    """A training handler that answers with ``DELTA`` and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, message: Message, _context: Context) -> Message:
        self.calls += 1
        return Message(train_reply(DELTA, 5, {"train-loss": 0.5}), reply_to=message)


def test_dp_clips_the_trained_update_and_weighs_the_client_one() -> None:
    # Prepare: clip to 1, no noise
    message, handler = _instruction(ClientDPConfig(clip=1.0).to_settings()), Handler()

    # Execute
    out = dp_mod(message, _context(), handler)

    # Assert: (3, 4)/5, the rest zero (the clip keeps a margin of 1e-6 below C: within 2e-6), within the clip;
    # the reply's other metrics kept; secure aggregation's weight 1
    sent = own_update(out.content)
    assert sent is not None
    np.testing.assert_allclose(sent, np.r_[0.6, 0.8, np.zeros(18)], rtol=2e-6)
    assert float(np.linalg.norm(sent)) <= 1.0
    assert dict(out.content["metrics"]) == {"num-examples": 5, "train-loss": 0.5, "secagg-weight": 1.0}


def test_dp_adds_noise_of_the_configured_size() -> None:
    # Prepare: a zero update never clipped, noise std 2 over 20 coordinates, many draws
    message = _instruction(ClientDPConfig(clip=100.0, noise_std=2.0).to_settings())

    def zero(m: Message, _c: Context) -> Message:
        return Message(train_reply(np.zeros(20_000, np.float32), 5, {}), reply_to=m)

    # Execute
    sent = own_update(dp_mod(message, _context(), zero).content)

    # Assert: the sample's std is 2 (20,000 draws: within 3%)
    assert sent is not None and abs(float(sent.std()) - 2.0) < 0.06


def test_dp_refuses_discrete_noise_without_secure_aggregation_before_training() -> None:
    handler = Handler()
    with pytest.raises(UpdateRejected, match="discrete DP noise, which only secure aggregation adds"):
        dp_mod(_instruction(ClientDPConfig(clip=1.0, discrete=True).to_settings()), _context(), handler)
    assert handler.calls == 0


def test_compression_keeps_the_largest_coordinates_and_the_rest_for_later() -> None:
    # Prepare: top-k 10% with error feedback
    codec, context = Codec(topk=0.1), _context()

    # Execute
    out = compression_mod(_instruction(codec.to_settings()), context, Handler())

    # Assert: the two largest (3 and 4) sent; nothing left, since the rest is zero
    sent = codec.decode(dict(out.content["update"]), 20)
    np.testing.assert_array_equal(sent, DELTA)
    assert "residual" in context.state["quorum.residual"]


def test_compression_refuses_top_k_under_secure_aggregation_before_training() -> None:
    handler = Handler()
    with pytest.raises(UpdateRejected, match="only random-k compression applies"):
        compression_mod(_instruction(Codec(topk=0.1).to_settings(), secure=True), _context(), handler)
    assert handler.calls == 0


@pytest.mark.parametrize("mod", [dp_mod, compression_mod])
def test_a_message_without_the_feature_or_not_quorums_passes_through(mod: Mod) -> None:
    # Prepare: a round without DP or compression, and a stock Flower server's instruction
    plain = _instruction({})
    flower = Message(RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(3, np.float32))}),
                                 "config": ConfigRecord({"lr": 0.1})}), dst_node_id=7, message_type="train")
    for message in (plain, flower):
        handler = Handler()
        reply = Message(train_reply(DELTA, 5, {}), reply_to=message)

        # Execute
        out = mod(message, _context(), lambda _m, _c, r=reply, h=handler: (h(_m, _c), r)[1])

        # Assert: the handler's reply itself, untouched
        assert out is reply and handler.calls == 1


def test_the_mods_compose_in_the_documented_order() -> None:
    # an edge aggregator's messages first (no device mod touches them), then secure aggregation, the site policy
    # (before anything reads the node's data), the attack harness, compression, DP, and standardisation next to
    # the handler
    mods = client_mods()
    assert [getattr(m, "__name__", type(m).__name__) for m in mods] == ["edge_mod", "secagg_mod", "policy_mod",
                                                                          "AttackMod",
                                                                          "StatisticsMod", "compression_mod", "dp_mod",
                                                                          "standardize_mod"]


def test_the_handlers_only_train_and_score_through_the_task() -> None:
    import inspect

    from clients.clientapp import evaluate_handler, train_handler

    for handler in (train_handler, evaluate_handler):
        source = inspect.getsource(handler)
        for feature in ("Standardization", "standardized", "ClientDPConfig", "client_payload", "Codec",
                        "statistics", "secure_rng"):
            assert feature not in source, (handler.__name__, feature)


def test_standardize_mod_hands_the_handler_the_instructions_view_and_leaves_none_behind() -> None:
    # Prepare: an instruction with the features' mean (1, 2) and std (2, 4); a node whose state holds a stale view
    view = Standardization(np.array([1.0, 2.0], np.float32), np.array([2.0, 4.0], np.float32))
    seen: list[Standardization | None] = []

    def handler(message: Message, context: Context) -> Message:
        seen.append(data_view(context.state))
        return Message(train_reply(np.zeros(20, np.float32), 2, {}), reply_to=message)

    context = _context()
    context.state[DATA_VIEW_KEY] = ConfigRecord({"mean": [9.0], "std": [9.0]})

    # Execute: one message with the view, one without
    standardize_mod(_instruction(view.to_settings()), context, handler)
    after_first = DATA_VIEW_KEY in context.state
    standardize_mod(_instruction({}), context, handler)

    # Assert: (x - mean) / std of a row (3, 10) is (1, 2); the stale view never reached the handler
    assert seen[0] is not None and seen[1] is None and not after_first and DATA_VIEW_KEY not in context.state
    np.testing.assert_array_equal(seen[0].apply(np.array([[3.0, 10.0]], np.float32)), [[1.0, 2.0]])


def test_a_malformed_standardisation_is_refused_before_the_handler_runs() -> None:
    handler = Handler()
    with pytest.raises(UpdateRejected, match="standardisation is malformed"):
        standardize_mod(_instruction({STD_MEAN: [0.0, 0.0], STD_STD: [1.0, -1.0]}), _context(), handler)
    assert handler.calls == 0


class Rows:
    """A node's training data: two rows of two features."""

    x = np.array([[1.0, 2.0], [3.0, 4.0]])


def test_a_statistics_pass_is_answered_from_the_features_without_training_or_compression() -> None:
    # Prepare: the means pass at scale 1, in a round that also asks for top-k compression; the statistics mod
    # outside compression, as client_mods composes them
    settings = {STD_PASS: "means", STD_SCALES: [1.0, 1.0], STD_LIMIT: 1e6, **Codec(topk=0.5).to_settings()}
    handler, stats = Handler(), StatisticsMod(features_of=lambda _context: Rows)

    # Execute
    out = stats(_instruction(settings), _context(), lambda m, c: compression_mod(m, c, handler))

    # Assert: the column means (2, 3) as a dense delta weighted by the 2 rows; nothing trained or encoded
    assert handler.calls == 0
    np.testing.assert_array_equal(own_update(out.content), [2.0, 3.0])
    assert out.content["metrics"]["num-examples"] == 2


def test_a_statistics_pass_on_data_without_features_is_refused() -> None:
    stats = StatisticsMod(features_of=lambda _context: object())
    with pytest.raises(UpdateRejected, match="needs feature arrays"):
        stats(_instruction({STD_PASS: "means"}), _context(), Handler())
