"""The ClientApp's train and evaluate handlers, called the way every runtime calls them.

A node's data comes from its node config (``partition-id``) and the scenario
from the run config (``scenario-json``); the instruction and the reply are
the wire format of ``core.instructions`` and ``core.replies``, so the aggregator's own parser must
accept what the client sends.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict

from clients.clientapp import app
from core.eval_replies import parse_eval_reply
from core.instructions import TrainConfig, train_instruction
from core.replies import parse_train_reply
from learning.federation import cached_federation
from learning.models import build_model, get_flat
from runtimes.inprocess import InProcessGrid, NodeSpec
from scenarios.schema import Scenario
from tests.conftest import tiny_scenario

PARTITION = 2
MAX_BYTES = 1 << 20


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    with InProcessGrid(app, [NodeSpec(1)], run_config={}):  # sets Flower's task identity, as a runtime does
        yield tiny_scenario()


def _params(scenario: Scenario) -> np.ndarray:
    fed = cached_federation(scenario)
    return get_flat(build_model(scenario.model.name, fed.input_shape, fed.num_classes, seed=scenario.seed))


def _context(scenario: Scenario, node_id: int = 7) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={"partition-id": PARTITION, "num-partitions": 4},
                   state=RecordDict(), run_config={"scenario-json": json.dumps(scenario.to_dict())})


def _message(params: np.ndarray, message_type: str, node_id: int = 7, **settings: float) -> Message:
    config = TrainConfig(round=1, epochs=1, batch_size=16, lr=0.1, seed=3, settings=dict(settings))
    message = Message(train_instruction(params, config), node_id, message_type, group_id="1")
    message.metadata.__dict__["_message_id"] = f"{message_type}-{node_id}"  # a SuperLink assigns it
    return message


def test_train_reply_parses_with_the_partitions_example_count(scenario: Scenario) -> None:
    # Prepare
    params = _params(scenario)
    expected = len(cached_federation(scenario).clients[PARTITION].train)

    # Execute
    reply = app(_message(params, "train"), _context(scenario))

    # Assert
    parsed = parse_train_reply(reply.content, size=params.size, max_bytes=MAX_BYTES)
    assert parsed.num_examples == expected
    assert parsed.delta.shape == params.shape and np.isfinite(parsed.delta).all()
    assert np.abs(parsed.delta).max() > 0  # it did train
    assert parsed.metrics["train-loss"] > 0 and "secagg-weight" not in parsed.metrics
    assert reply.metadata.reply_to_message_id == "train-7"


def test_the_same_instruction_to_the_same_node_gives_the_same_update(scenario: Scenario) -> None:
    # Prepare: the node's model is kept between messages; the instruction's params must win
    params = _params(scenario)

    # Execute
    first = app(_message(params, "train"), _context(scenario))
    again = app(_message(params, "train"), _context(scenario))
    other = app(_message(params, "train", node_id=8), _context(scenario, node_id=8))

    # Assert: the seed is (run seed, round, node), so only the node id changes the shuffle
    deltas = [parse_train_reply(r.content, params.size, MAX_BYTES).delta for r in (first, again, other)]
    np.testing.assert_array_equal(deltas[0], deltas[1])
    assert not np.array_equal(deltas[0], deltas[2])


def test_a_dp_round_clips_the_update_on_the_client(scenario: Scenario) -> None:
    # Prepare: clip at 0.01 without noise, so the bound is exact
    params = _params(scenario)

    # Execute
    reply = app(_message(params, "train", **{"dp-clip": 0.01}), _context(scenario))

    # Assert
    parsed = parse_train_reply(reply.content, params.size, MAX_BYTES)
    assert 0 < np.linalg.norm(parsed.delta.astype(np.float64)) <= 0.01
    assert parsed.metrics["secagg-weight"] == 1.0


def test_evaluate_scores_the_global_model_on_the_local_test_split(scenario: Scenario) -> None:
    # Prepare
    params = _params(scenario)
    data = cached_federation(scenario).clients[PARTITION]

    # Execute
    reply = app(_message(params, "evaluate"), _context(scenario))

    # Assert
    parsed = parse_eval_reply(reply.content)
    assert parsed.num_examples == len(data.test)
    assert parsed.train_examples == len(data.train)
    assert 0.0 <= parsed.accuracy <= 1.0 and parsed.loss > 0
