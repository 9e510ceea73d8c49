"""The site policy in the ClientApp: a round that breaks it is refused before the node's data is read, and the
refusal carries its reason back as a reply the aggregator recognises (issue 48, item 5).

The real ClientApp (``clients.clientapp.app``) is called as every runtime calls it; the node's data loader is
watched, so a refused message is seen not to read the data at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict

import clients.clientapp as clientapp
from clients.clientapp import app
from clients.policy.mod import policy_mod
from core.instructions import COHORT, TrainConfig, train_instruction
from core.outcomes import REFUSED, error_outcome
from core.replies import REFUSAL_CODE, parse_train_reply, refusal_reason
from learning.federation import cached_federation
from learning.models import build_model, get_flat
from privacy.secagg.flower_workflow import run_secagg
from privacy.secagg.train import config_from_spec
from runtimes.inprocess import InProcessGrid, NodeSpec
from scenarios.schema import Scenario
from tests.conftest import tiny_scenario

SCENARIO = tiny_scenario(secagg={"enabled": True, "threat_model": "semi-honest", "threshold": 2})


@pytest.fixture(scope="module")
def identity() -> Iterator[None]:
    with InProcessGrid(app, [NodeSpec(1)], run_config={}):  # sets Flower's task identity, as a runtime does
        yield


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every read of a node's data, by node config (the ClientApp's one way to its data)."""
    seen: list[dict[str, Any]] = []
    real = clientapp._node_data

    def watched(task: Any, scenario: Scenario, node: dict[str, Any]) -> Any:
        seen.append(node)
        return real(task, scenario, node)

    monkeypatch.setattr(clientapp, "_node_data", watched)
    return seen


def _params() -> np.ndarray:
    fed = cached_federation(SCENARIO)
    return get_flat(build_model(SCENARIO.model.name, fed.input_shape, fed.num_classes, seed=SCENARIO.seed))


def _run_config() -> dict[str, str]:
    return {"scenario-json": json.dumps(SCENARIO.to_dict())}


def _context(node: dict[str, Any], node_id: int = 7) -> Context:
    return Context(run_id=1, node_id=node_id, node_config=node, state=RecordDict(), run_config=_run_config())


def _train(params: np.ndarray, cohort: int = 4, extra: RecordDict | None = None) -> Message:
    config = TrainConfig(round=1, epochs=1, batch_size=16, lr=0.1, seed=3).with_settings({COHORT: cohort})
    content = train_instruction(params, config)
    for name, record in (extra or {}).items():
        content[name] = record
    message = Message(content, 7, "train", group_id="1")
    message.metadata.__dict__["_message_id"] = "train-7"  # a SuperLink assigns it
    return message


def _policy(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    return path


def test_a_plain_round_is_refused_without_reading_the_data_and_the_reply_says_why(
        identity: None, reads: list[dict[str, Any]], tmp_path: Path) -> None:
    # Prepare: the device's data file does not even exist; its policy wants secure aggregation
    policy = _policy(tmp_path, "require_secure_aggregation = true\n")
    node = {"data-path": str(tmp_path / "never-read.csv"), "site-policy": str(policy)}

    # Execute
    reply = app(_train(_params()), _context(node))

    # Assert: an error reply of its own kind, with the rule; the aggregator reads it as ``refused``
    assert reads == []
    assert reply.has_error() and reply.error.code == REFUSAL_CODE
    assert refusal_reason(reply.error) == "secure aggregation required"
    assert error_outcome(reply.error) == (REFUSED, "secure aggregation required")
    assert reply.metadata.reply_to_message_id == "train-7"


def test_the_same_round_on_a_device_without_a_policy_reads_its_data(identity: None,
                                                                    reads: list[dict[str, Any]]) -> None:
    # the control: the watch sees a read when nothing refuses (a simulated partition here)
    params = _params()

    reply = app(_train(params), _context({"partition-id": 1, "num-partitions": 4}))

    assert len(reads) == 1 and not reply.has_error()
    assert parse_train_reply(reply.content, params.size, 1 << 20).num_examples > 0


def test_a_round_under_secure_aggregation_is_accepted_and_trains(identity: None, reads: list[dict[str, Any]],
                                                                 tmp_path: Path) -> None:
    # Prepare: three nodes in a secure round (semi-honest, t = 2); node 1 requires secure aggregation
    policy = _policy(tmp_path, "require_secure_aggregation = true\nmin_cohort = 3\n")
    nodes = [NodeSpec(n, {"partition-id": n - 1, "num-partitions": 4, "secagg-threat-model": "semi-honest",
                          **({"site-policy": str(policy)} if n == 1 else {})}) for n in (1, 2, 3)]
    content = train_instruction(_params(), TrainConfig(round=1, epochs=1, batch_size=16, lr=0.1, seed=3)
                                .with_settings({COHORT: 3}))

    # Execute
    with InProcessGrid(app, nodes, _run_config()) as grid:
        result = run_secagg(grid, [1, 2, 3], content, config_from_spec(SCENARIO.secagg), server_round=1,
                            rng=np.random.default_rng(0))

    # Assert: node 1 is in the sum, having read its data once, like the others
    assert set(result.survivors) == {1, 2, 3}
    assert sorted(n["partition-id"] for n in reads) == [0, 1, 2]
    assert not any(s.refused for s in result.stages)


def test_a_secure_aggregation_flag_without_the_protocol_is_no_secure_aggregation(tmp_path: Path,
                                                                                identity: None) -> None:
    # Prepare: a train message carrying a "secagg" record whose protocol never ran on this node
    policy = _policy(tmp_path, "require_secure_aggregation = true\n")
    forged = RecordDict({"secagg": ConfigRecord({"stage": "masked_input", "round": 1, "payload": b""})})
    called: list[Message] = []

    # Execute: the policy mod alone (inside the app, secure aggregation's mod would refuse it first)
    reply = policy_mod(_train(_params(), extra=forged), _context({"site-policy": str(policy)}),
                       lambda m, _c: called.append(m) or m)

    # Assert
    assert called == [] and refusal_reason(reply.error) == "secure aggregation required"


def test_an_edited_policy_is_read_again_and_a_missing_one_refuses(identity: None, reads: list[dict[str, Any]],
                                                                  tmp_path: Path) -> None:
    # Prepare: no rule at first
    policy = _policy(tmp_path, "")
    node = {"partition-id": 0, "num-partitions": 4, "site-policy": str(policy)}

    # Execute
    first = app(_train(_params(), cohort=4), _context(node))
    policy.write_text("min_cohort = 5\n")
    second = app(_train(_params(), cohort=4), _context(node))
    policy.unlink()
    third = app(_train(_params(), cohort=9), _context(node))

    # Assert: one read, by the round the first policy let through
    assert not first.has_error() and len(reads) == 1
    assert refusal_reason(second.error) == "cohort 4 under min_cohort 5"
    assert refusal_reason(third.error) == "the site policy cannot be read (the device's log says why)"


def test_the_rounds_of_a_day_are_counted_on_the_device(identity: None, tmp_path: Path) -> None:
    # Prepare: two rounds a day at most, counted in the agent's own folder
    policy = _policy(tmp_path, "max_rounds_per_day = 2\n")
    count = tmp_path / "agent" / "policy-rounds.json"
    node = {"partition-id": 0, "num-partitions": 4, "site-policy": str(policy), "site-policy-rounds": str(count)}

    # Execute
    replies = [app(_train(_params()), _context(node)) for _ in range(3)]

    # Assert
    assert [r.has_error() for r in replies] == [False, False, True]
    assert refusal_reason(replies[2].error) == "2 rounds trained in the last 24 h (max_rounds_per_day = 2)"
    assert len(json.loads(count.read_text())["trained"]) == 2
