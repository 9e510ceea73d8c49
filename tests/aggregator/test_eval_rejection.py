"""An evaluate reply the aggregator refuses is recorded as rejected, with the reason (issue 32).

It used to be dropped silently: the client showed ``ok``, with no figures and
no reason. Scripted clients on a real in-process run (``run_federation``).
"""

from __future__ import annotations

import math
import time

import numpy as np
from flwr.app import RecordDict

from core.eval_replies import eval_reply
from tests.aggregator.test_untrusted_clients import honest, run
from tests.conftest import tiny_scenario


def nan_loss_from_node_4(kind: str, node: int, round_: int, params: np.ndarray) -> RecordDict:
    if kind == "evaluate":
        return eval_reply(math.nan if node == 4 else 0.5, 0.5, 10)
    return honest(node, params)


def test_an_eval_reply_with_a_nan_loss_is_rejected_with_the_reason(db_url: str) -> None:
    # Prepare: four clients train honestly; node 4 scores the global model with a NaN loss
    scenario = tiny_scenario(rounds=1, evaluation={"federated": True, "server": False})
    # Execute
    store, run_id, result = run(scenario, nan_loss_from_node_4, db_url)
    # Assert: node 4 says why; the others' figures make the federated score
    records = {c.client: c for c in store.client_results(run_id)}
    assert (records["4"].outcome, records["4"].stage) == ("rejected", "evaluate")
    assert "eval loss is nan" in records["4"].reason
    assert [(records[n].outcome, records[n].eval_loss) for n in "123"] == [("ok", 0.5)] * 3
    (row,) = store.rounds(run_id)
    assert (row.fed_loss, row.answered, row.rejected) == (0.5, 3, 1)
    assert result.status == "degraded"  # every round ran; one client's reply was refused


def test_a_client_asked_only_to_evaluate_gets_a_rejected_record_of_its_own(db_url: str) -> None:
    # Prepare: half the clients train each round; every client evaluates; node 4 answers NaN
    scenario = tiny_scenario(rounds=1, federation={"fraction": 0.5, "min_clients": 1},
                             evaluation={"federated": True, "server": False, "clients": "all"})
    # Execute
    store, run_id, _ = run(scenario, nan_loss_from_node_4, db_url)
    # Assert: node 4 has exactly one record, rejected at evaluate, whether or not it trained
    mine = [c for c in store.client_results(run_id) if c.client == "4"]
    assert [(c.outcome, c.stage) for c in mine] == [("rejected", "evaluate")]
    assert "eval loss is nan" in mine[0].reason


def test_a_client_that_trains_then_never_evaluates_is_dropped_at_evaluate_within_the_deadline(db_url: str) -> None:
    # Prepare: node 4 answers its training, then its evaluation comes only after the round's 1.5 s deadline
    # (a device killed between the two replies)
    def silent_after_training(kind: str, node: int, round_: int, params: np.ndarray) -> RecordDict:
        if kind == "evaluate" and node == 4:
            time.sleep(4.0)
        return eval_reply(0.5, 0.5, 10) if kind == "evaluate" else honest(node, params)

    scenario = tiny_scenario(rounds=1, federation={"deadline_s": 1.5},
                             evaluation={"federated": True, "server": False})

    # Execute
    store, run_id, result = run(scenario, silent_after_training, db_url)

    # Assert: node 4 is dropped at evaluate, said so; the round's score is the other three's and says one is
    # missing; the round ended within its deadline (plus the work around it), not 30 s later
    records = {c.client: c for c in store.client_results(run_id)}
    assert (records["4"].outcome, records["4"].stage) == ("dropped", "evaluate")
    assert "no evaluation reply" in records["4"].reason
    assert [(records[n].outcome, records[n].eval_loss) for n in "123"] == [("ok", 0.5)] * 3
    (row,) = store.rounds(run_id)
    assert (row.fed_loss, row.answered, row.dropped) == (0.5, 3, 1)
    assert row.metrics["eval-dropped"] == 1
    assert row.duration_s < 1.5 + 1.5, row.duration_s
    assert result.status == "degraded"
