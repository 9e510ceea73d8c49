"""Server side over Flower: drive one secure-aggregation round through a ``Grid``.

The round loop calls :func:`run_secagg` instead of its plain train step. Each
stage is one push of messages and a polling loop until every live client has
answered or the stage deadline passes; a client that errs, times out or
sends something the server rejects has dropped out at that stage (Bonawitz
et al., CCS 2017, recover from dropouts at any point; Flower's own SecAgg+
workflow aborts on a dropout before the masked-input stage).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.serverapp import Grid

from core.boundary import one_line
from core.outcomes import FAILED, REFUSED, error_outcome
from core.replies import clean_metrics
from core.wire import wire_bytes
from privacy.secagg.config import SecAggConfig
from privacy.secagg.errors import SecAggCryptoError, SecAggProtocolError
from privacy.secagg.flower_mod import METRICS_RECORD
from privacy.secagg.flower_records import content_bytes, read_reply, record_of, request_content
from privacy.secagg.identity import IdentityDirectory
from privacy.secagg.messages import Request
from privacy.secagg.result import SecureSumResult, ServerTimer, StageStats
from privacy.secagg.server import ServerRound
from privacy.secagg.stage import Stage

__all__ = ["run_secagg"]

POLL_INTERVAL_S = 0.005


class _Stage:
    """Book-keeping of one stage: server time, bytes, training metrics, replies rejected and why."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.start = clock()
        self.server = ServerTimer(clock)
        self.up = 0
        self.down = 0
        self.wire_up: dict[int, int] = {}
        self.wire_down: dict[int, int] = {}
        self.rejected: dict[int, str] = {}
        self.failed: dict[int, str] = {}
        self.refused: dict[int, str] = {}


def _messages(stage: Stage, round_id: int, requests: Mapping[int, Request],
              train_content: RecordDict, config: SecAggConfig) -> dict[int, Message]:
    extra = train_content if stage is Stage.MASKED_INPUT else None
    ttl = config.stage_timeout_s
    out = {}
    for node, request in sorted(requests.items()):
        content = request_content(stage, round_id, request, extra, config.client_metrics)
        out[node] = Message(content, dst_node_id=node, message_type=MessageType.TRAIN,
                            group_id=str(round_id), ttl=ttl)
    return out


def _accept(server: ServerRound, stage: Stage, round_id: int, node: int, reply: Message,
            book: _Stage, metrics: dict[int, dict[str, Any]] | None) -> None:
    if reply.has_content():
        book.wire_up[node] = wire_bytes(reply.content)
    if reply.has_error():  # this client dropping out: gone, or its task raised (kept, with the error)
        outcome, reason = error_outcome(reply.error)
        if outcome == FAILED:
            book.failed[node] = reason
        elif outcome == REFUSED:  # its site policy refused the round (clients.policy): kept, with the rule
            book.refused[node] = reason
        return
    if reply.metadata.src_node_id != node:
        return
    book.up += content_bytes(reply.content)
    try:
        parsed = read_reply(stage, round_id, reply.content)
        book.server.run(server.accept, node, parsed)
    except (SecAggProtocolError, SecAggCryptoError) as exc:  # read_reply turns anything else into the former
        book.rejected[node] = one_line(exc)
        return
    record = record_of(reply.content, METRICS_RECORD, MetricRecord)
    if stage is Stage.MASKED_INPUT and record is not None and metrics is not None:
        metrics[node] = clean_metrics(dict(record))  # untrusted: bounded numbers only (issue 12)


def _run_stage(grid: Grid, server: ServerRound, stage: Stage, round_id: int,
               train_content: RecordDict, config: SecAggConfig, metrics: dict[int, dict[str, Any]],
               clock: Callable[[], float], sleep: Callable[[float], None]) -> StageStats:
    book = _Stage(clock)
    requests: Mapping[int, Request] = book.server.run(server.requests)
    messages = _messages(stage, round_id, requests, train_content, config)
    kept = metrics if config.client_metrics else None  # not asked for: not kept, even if sent
    book.down = sum(content_bytes(m.content) for m in messages.values())
    book.wire_down = {node: wire_bytes(m.content) for node, m in messages.items()}
    ids = list(grid.push_messages(list(messages.values())))
    node_of = dict(zip(ids, messages, strict=True))
    pending, deadline = set(ids), book.start + config.stage_timeout_s
    # An in-process grid can tell when no reply can come any more (a dropped
    # node is gone for good); then the stage closes before its deadline.
    settled = getattr(grid, "settled", lambda _ids: False)
    while pending:
        for reply in grid.pull_messages(list(pending)):
            message_id = reply.metadata.reply_to_message_id
            if message_id in pending:
                pending.discard(message_id)
                _accept(server, stage, round_id, node_of[message_id], reply, book, kept)
        if not pending or clock() >= deadline or settled(list(pending)):
            break
        sleep(POLL_INTERVAL_S)
    book.server.run(server.close)
    return StageStats(stage, server.completed[stage], book.up, book.down,
                      clock() - book.start, book.server.total, book.wire_up, book.wire_down, book.rejected,
                      book.failed, book.refused)


def run_secagg(grid: Grid, node_ids: Sequence[int], train_content: RecordDict, config: SecAggConfig,
               *, server_round: int, rng: np.random.Generator,
               clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
               entropy: Callable[[int], bytes] = os.urandom,
               directory: IdentityDirectory | None = None) -> SecureSumResult:
    """Run one secure-aggregation round over ``grid`` and return the unmasked sum.

    Parameters
    ----------
    grid : Grid
        Any Flower grid (in-process, simulation or deployment).
    node_ids : Sequence[int]
        The sampled nodes; each must run :func:`~privacy.secagg.flower_mod.secagg_mod`
        on its train handler.
    train_content : RecordDict
        The global model and training config; embedded in the MASKED_INPUT
        messages, whose replies carry the training metrics back.
    config : SecAggConfig
        Protocol parameters; ``stage_timeout_s`` is each stage's deadline.
    server_round : int
        The FL round, bound into every key (and the messages' ``group_id``).
    rng : np.random.Generator
        Accepted for symmetry with the other aggregators; the server draws no
        randomness but the graph seed, which comes from ``entropy``.
    clock, sleep, entropy
        Injected time and randomness sources (tests).
    directory : IdentityDirectory | None
        The enrolment directory, if the server has it (malicious model): a
        client whose signature does not verify then drops out at once.

    Returns
    -------
    SecureSumResult
        ``sum w_i x_i`` over the survivors, per-stage costs and the
        survivors' training metrics.

    Raises
    ------
    SecAggAborted
        Too few clients survived a stage.
    """
    del rng
    server = ServerRound(node_ids, config, round_id=server_round, entropy=entropy, directory=directory)
    metrics: dict[int, dict[str, Any]] = {}
    stages = []
    while (stage := server.stage) is not None:
        stages.append(_run_stage(grid, server, stage, server_round, train_content, config, metrics, clock, sleep))
    total, weight = server.result()
    survivors = server.survivors
    return SecureSumResult(total, weight, survivors, tuple(stages), server.error_bound(),
                           {u: metrics[u] for u in survivors if u in metrics})
