"""A client that does not answer is ``dropped``, one whose task raised ``failed``, one whose reply is refused
``rejected``: each with its reason, in the store's counts and in the run's status (issue 32, items 5 and 6).

A deployed device killed mid-round reaches the round loop as the reply the SuperLink makes for it
(``ErrorCode.NODE_UNAVAILABLE``, built here by Flower's own function), not as an error of the client's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from flwr.app import Error, Message
from flwr.common.constant import ErrorCode
from flwr.server.superlink.linkstate.utils import (
    create_message_error_unavailable_ins_message,
    create_message_error_unavailable_res_message,
)

from core.eval_replies import eval_reply
from core.instructions import parse_instruction
from core.outcomes import DROPPED, FAILED, clean_reason, error_outcome, run_problems
from runstore.store import RunStore
from tests.aggregator.test_untrusted_clients import NO_EVAL, honest, run_federation
from tests.conftest import tiny_scenario

#: What a SuperNode answers when its ClientApp raised (flwr/supernode/runtime/run_clientapp.py's wording).
SUPERNODE_RAISED = "<class 'learning.errors.DataError'>:<'local.csv: no label column 'label''>"


def federation_with_a_dead_and_a_broken_node(message: Message, context) -> Message:
    """Nodes 1, 2 answer; node 3 is a SuperNode killed mid-round (the SuperLink answers for it, as it does once
    the node's heartbeat lapses); node 4's task raises, as its SuperNode reports it."""
    if context.node_id == 3:
        return create_message_error_unavailable_res_message(message.metadata, "node_unavail")
    if context.node_id == 4:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=SUPERNODE_RAISED), reply_to=message)
    params, _ = parse_instruction(message.content)
    return Message(honest(context.node_id, params), reply_to=message)


def test_a_dead_node_is_dropped_and_a_raised_task_failed_in_the_records_counts_and_status(db_url: str) -> None:
    # Prepare: two rounds, four nodes, two of them useless every round
    from runtimes.inprocess import InProcessGrid, NodeSpec

    scenario = tiny_scenario(rounds=2, evaluation=NO_EVAL)
    store = RunStore(db_url)

    # Execute
    with InProcessGrid(federation_with_a_dead_and_a_broken_node, [NodeSpec(i + 1, {}) for i in range(4)], {}) as grid:
        run_id, result = run_federation(grid, scenario, store, engine="inprocess")

    # Assert: per client, the outcome and the reason (the SuperNode's wording made one line)
    for server_round in (1, 2):
        records = {c.client: c for c in store.client_results(run_id, server_round)}
        assert [records[n].outcome for n in "1234"] == ["ok", "ok", "dropped", "failed"]
        assert records["3"].reason.startswith("Error: Node Unavailable")
        assert records["4"].reason == "DataError: local.csv: no label column 'label'"
    # the round's counts, and the run: every round learned, but not from everyone
    assert [(r.answered, r.dropped, r.rejected, r.failed) for r in store.rounds(run_id)] == [(2, 1, 0, 1)] * 2
    run = store.get_run(run_id)
    assert (result.status, run.status) == ("degraded", "degraded")
    assert run.error == ("client 3 never contributed (dropped in 2 of 2 rounds); client 4 failed in 2 of 2 rounds "
                         "(DataError: local.csv: no label column 'label')")


@pytest.mark.parametrize(("code", "outcome"), [
    (ErrorCode.NODE_UNAVAILABLE, DROPPED), (ErrorCode.REPLY_MESSAGE_UNAVAILABLE, DROPPED),
    (ErrorCode.MESSAGE_UNAVAILABLE, DROPPED), (ErrorCode.CLIENT_APP_CRASHED, DROPPED),
    (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, FAILED), (ErrorCode.LOAD_CLIENT_APP_EXCEPTION, FAILED),
    (ErrorCode.MOD_FAILED_PRECONDITION, FAILED), (ErrorCode.UNKNOWN, FAILED),
])
def test_each_flower_error_code_is_a_drop_or_a_failure(code: int, outcome: str) -> None:
    assert error_outcome(Error(code=code, reason="x"))[0] == outcome


def test_the_superlinks_own_replies_for_a_lost_message_are_drops() -> None:
    # Prepare: the two replies Flower's SuperLink makes up, for a message past its TTL and for one unknown
    instruction = Message(honest(1, np.zeros(3, np.float32)), dst_node_id=1, message_type="train")
    instruction.metadata.__dict__["_message_id"] = "m1"
    expired = create_message_error_unavailable_res_message(instruction.metadata, "msg_unavail")
    unknown = create_message_error_unavailable_ins_message("m1", run_id=1)
    # Execute / Assert
    assert error_outcome(expired.error) == (DROPPED, "Error: Reply Message Unavailable - The reply message has "
                                                     "expired.")
    assert error_outcome(unknown.error)[0] == DROPPED


def test_a_reason_is_one_bounded_line() -> None:
    assert clean_reason(SUPERNODE_RAISED) == "DataError: local.csv: no label column 'label'"
    assert clean_reason("ValueError: a\n  b") == "ValueError: a b"
    assert len(clean_reason("x" * 1000)) == 300


def test_injected_dropouts_do_not_degrade_a_run_but_failures_still_do() -> None:
    # Prepare: client 2 dropped in its only round, client 3 failed once and answered once
    results = [_Row("1", "ok", None, 1), _Row("2", "dropped", "no reply within 20 s", 1),
               _Row("3", "failed", "OSError: disk full", 1), _Row("3", "ok", None, 2)]
    # Execute / Assert
    assert run_problems(results, {"3": "ward-3"}) == [
        "client 2 never contributed (dropped in 1 of 1 rounds)", "ward-3 failed in 1 of 2 rounds (OSError: disk full)"]
    assert run_problems(results, drops_expected=True) == ["client 3 failed in 1 of 2 rounds (OSError: disk full)"]
    assert run_problems([_Row(str(n), "error", "old", 1) for n in range(5)], shown=2)[-1] == "and 3 more clients"


class _Row(NamedTuple):
    """A stored client result, as the run store returns it."""

    client: str
    outcome: str
    reason: str | None
    round: int


def node_3_gone_at_evaluation(message: Message, context) -> Message:
    """Every node trains; node 3 is gone by the evaluation (the SuperLink answers for it)."""
    if message.metadata.message_type == "evaluate":
        if context.node_id == 3:
            return create_message_error_unavailable_res_message(message.metadata, "node_unavail")
        return Message(eval_reply(0.5, 0.5, 10), reply_to=message)
    params, _ = parse_instruction(message.content)
    return Message(honest(context.node_id, params), reply_to=message)


def test_a_node_gone_by_its_evaluation_is_dropped_at_evaluate(db_url: str) -> None:
    # Prepare: one round with federated evaluation; node 3 trained, then its SuperLink reports it unavailable
    from runtimes.inprocess import InProcessGrid, NodeSpec

    scenario = tiny_scenario(rounds=1, evaluation={"federated": True, "server": False})
    store = RunStore(db_url)

    # Execute
    with InProcessGrid(node_3_gone_at_evaluation, [NodeSpec(i + 1, {}) for i in range(3)], {}) as grid:
        run_id, _ = run_federation(grid, scenario, store, engine="inprocess")

    # Assert: its update counted, its evaluation missing and said so; the score is the other two's
    records = {c.client: c for c in store.client_results(run_id, 1)}
    assert (records["3"].outcome, records["3"].stage) == ("dropped", "evaluate")
    assert [records[n].outcome for n in "12"] == ["ok", "ok"]
    (row,) = store.rounds(run_id)
    assert row.metrics["eval-dropped"] == 1 and row.fed_loss == 0.5
