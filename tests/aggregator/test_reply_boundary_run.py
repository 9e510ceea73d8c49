"""One client's junk bytes reject its reply, never the run (issue 32, "one client kills any run").

A real in-process federation (``run_federation`` over ``InProcessGrid``):
node 4 answers with an update whose ``.npy`` header has unbalanced brackets
(``'shape': (]]8,)``), on which numpy's header parser raises
``tokenize.TokenError``. The run must finish, the other clients' updates
folded, node 4 recorded as ``rejected`` with the reason.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from aggregator.serverapp import run_federation
from core.instructions import parse_instruction, read_instruction
from core.layouts import encode_named
from core.replies import train_reply
from privacy.secagg.flower_mod import secagg_mod
from privacy.secagg.flower_records import MASKED_RECORD
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from tests.aggregator.test_rounds import initial_params
from tests.aggregator.test_untrusted_clients import NO_EVAL, attacked_by_node_4, honest, run
from tests.conftest import tiny_scenario

BAD_SHAPE = b"'shape': (]]"


def token_error(data: bytes) -> bytes:
    """``data`` (``.npy`` bytes) with its shape's opening bracket made ``(]]``: same length field, bad tokens."""
    start = data.index(b"'shape': (")
    end = data.index(b")", start)
    shape = data[start + len(b"'shape': ("):end]
    header_end = data.index(b"\n") + 1
    # keep the header's length (numpy checks it): the two brackets replace two padding blanks
    fixed = data[:start] + BAD_SHAPE + shape + data[end:header_end - 3] + b"\n"
    return fixed + data[header_end:]


def corrupt_array(array: Array) -> Array:
    return Array(dtype=array.dtype, shape=tuple(array.shape), stype=array.stype, data=token_error(bytes(array.data)))


def test_the_corruption_keeps_the_header_length() -> None:
    good = train_reply(np.zeros(8, np.float32), 1, {})["update"]["delta"].data
    bad = token_error(bytes(good))
    assert len(bad) == len(good) and BAD_SHAPE in bad and bad.index(b"\n") == good.index(b"\n")


def plain_token_error(params: np.ndarray) -> RecordDict:
    reply = train_reply(np.full(params.size, -0.01, np.float32), 100, {})
    reply["update"] = ArrayRecord({"delta": corrupt_array(reply["update"]["delta"])})
    return reply


def flower_token_error(message: Message, context: Context) -> Message:
    """Node 4 answers as a Flower message-API client (full weights in ``arrays``), one tensor's header bad."""
    instruction = read_instruction(message.content)
    if message.metadata.message_type == "evaluate" or context.node_id != 4:
        return Message(honest(context.node_id, instruction.params), reply_to=message)
    weights = encode_named(instruction.params - 0.01, instruction.layout)
    first = next(iter(weights))
    weights[first] = corrupt_array(weights[first])
    content = RecordDict({"arrays": ArrayRecord(weights), "metrics": MetricRecord({"num-examples": 100})})
    return Message(content, reply_to=message)


def run_with(app, scenario, db_url: str, node_config: dict | None = None):
    store = RunStore(db_url)
    nodes = [NodeSpec(i + 1, dict(node_config or {})) for i in range(scenario.federation.clients)]
    with InProcessGrid(app, nodes, {}) as grid:
        run_id, result = run_federation(grid, scenario, store, engine="inprocess")
    return store, run_id, result


def assert_only_node_4_rejected(store: RunStore, run_id: str, stage: str) -> None:
    records = {c.client: c for c in store.client_results(run_id)}
    assert (records["4"].outcome, records["4"].stage) == ("rejected", stage)
    assert "TokenError" in records["4"].reason and "\n" not in records["4"].reason
    assert [records[n].outcome for n in "123"] == ["ok", "ok", "ok"]


def test_a_token_error_header_rejects_that_client_and_the_run_finishes(db_url: str) -> None:
    # Prepare: the honest mean is (0.001 + 0.002 + 0.003) / 3 = 0.002 per parameter
    scenario = tiny_scenario(rounds=1, evaluation=NO_EVAL)
    # Execute
    store, run_id, result = run(scenario, attacked_by_node_4(plain_token_error), db_url)
    # Assert
    assert_only_node_4_rejected(store, run_id, "train")
    np.testing.assert_allclose(store.load_state(run_id).params, initial_params(scenario) + 0.002, atol=1e-7)
    assert (result.status, store.get_run(run_id).status) == ("degraded", "degraded")  # it ran, with a refusal
    assert store.get_run(run_id).error.startswith("client 4 rejected in 1 of 1 rounds")


def test_a_token_error_in_a_flower_layout_reply_rejects_that_client_and_the_run_finishes(db_url: str) -> None:
    scenario = tiny_scenario(rounds=1, evaluation=NO_EVAL)
    store, run_id, result = run_with(flower_token_error, scenario, db_url)
    assert_only_node_4_rejected(store, run_id, "train")
    np.testing.assert_allclose(store.load_state(run_id).params, initial_params(scenario) + 0.002, atol=1e-7)
    assert (result.status, store.get_run(run_id).status) == ("degraded", "degraded")  # it ran, with a refusal
    assert store.get_run(run_id).error.startswith("client 4 rejected in 1 of 1 rounds")


# -- secure aggregation: node 4's masked input is the junk ------------------------------------------

SEMI = {"secagg-threat-model": "semi-honest"}


def secagg_app(bad_node: int) -> ClientApp:
    """Scripted clients behind the real secagg mod; ``bad_node``'s masked vector leaves with a bad header."""
    app = ClientApp()

    def corrupt(message: Message, context: Context, call_next) -> Message:
        reply = call_next(message, context)
        masked = reply.content.get(MASKED_RECORD) if reply.has_content() else None
        if context.node_id == bad_node and isinstance(masked, ArrayRecord):
            reply.content[MASKED_RECORD] = ArrayRecord({k: corrupt_array(a) for k, a in masked.items()})
        return reply

    @app.train(mods=[corrupt, secagg_mod])
    def train(message: Message, context: Context) -> Message:
        params, _ = parse_instruction(message.content)
        return Message(honest(context.node_id, params), reply_to=message)

    return app


def test_a_token_error_masked_input_rejects_that_client_and_the_secure_round_finishes(db_url: str) -> None:
    # Prepare: four clients, semi-honest secure aggregation (strict majority: 3 of 4 must survive)
    scenario = tiny_scenario(rounds=1, evaluation=NO_EVAL,
                             secagg={"enabled": True, "threat_model": "semi-honest", "stage_timeout_s": 20.0})
    # Execute
    store, run_id, result = run_with(secagg_app(bad_node=4), scenario, db_url, SEMI)
    # Assert: node 4 rejected at the masked-input stage, with numpy's reason; the others' mean applied
    assert_only_node_4_rejected(store, run_id, "masked_input")
    # secure aggregation quantises: the mean of 0.001, 0.002, 0.003 within its error bound
    np.testing.assert_allclose(store.load_state(run_id).params, initial_params(scenario) + 0.002, atol=1e-5)
    assert (result.status, store.get_run(run_id).status) == ("degraded", "degraded")  # it ran, with a refusal
    assert store.get_run(run_id).error.startswith("client 4 rejected in 1 of 1 rounds")
