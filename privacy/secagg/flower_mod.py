"""Client side over Flower: a ClientApp mod (middleware) that speaks the protocol.

Register it on the train handler: ``@app.train(mods=[secagg_mod])``. Messages
without a ``"secagg"`` ConfigRecord pass straight through. The setup stages
are answered by the mod itself; at MASKED_INPUT it runs the ordinary training
(``call_next``), then quantises, weights and masks the update (Bonawitz et
al., CCS 2017; Bell et al., CCS 2020) and replies with the masked vector in
place of ``"update"``, keeping ``"metrics"`` unless the request's header
asks for none (``[secagg] client_metrics = false``).

What the node accepts comes from its own node config, never from the
server: ``secagg-threat-model`` (default ``"malicious"``), its enrolled
identity key (``secagg-identity-key`` hex, or ``secagg-identity-key-file``)
and the enrolment directory (``secagg-directory`` path, or
``secagg-directory-json`` inline); see :mod:`privacy.secagg.identity`.
"""

from __future__ import annotations

import os

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode

from core.instructions import QUORUM_WIRE, TrainConfig
from privacy.dp.discrete import GridNoise
from privacy.dp.mechanisms import ClientDPConfig
from privacy.secagg.client import client_step
from privacy.secagg.errors import SecAggError
from privacy.secagg.flower_records import (
    RECORD,
    STATE_RECORD,
    metrics_wanted,
    ndarray_of,
    read_request,
    record_of,
    reply_content,
)
from privacy.secagg.identity import policy_from_node_config
from privacy.secagg.stage import Stage
from privacy.secagg.state import ClientState, state_from_bytes, state_to_bytes

__all__ = ["secagg_mod"]

UPDATE_RECORD = "update"
UPDATE_KEY = "delta"
METRICS_RECORD = "metrics"
WEIGHT_KEY = "num-examples"
OVERRIDE_WEIGHT_KEY = "secagg-weight"


class _TrainingFailed(Exception):
    """The wrapped ClientApp answered the training message with an error."""

    def __init__(self, reply: Message) -> None:
        super().__init__("training failed")
        self.reply = reply


def _load_state(context: Context, round_id: int) -> ClientState | None:
    record = record_of(context.state, STATE_RECORD, ConfigRecord)
    if record is None or record.get("round") != round_id:
        return None
    blob = record.get("blob")
    return state_from_bytes(blob) if isinstance(blob, bytes) else None


def _save_state(context: Context, round_id: int, state: ClientState) -> None:
    context.state[STATE_RECORD] = ConfigRecord(
        {"round": round_id, "blob": state_to_bytes(state)}
    )


def _instructed_noise(message: Message) -> GridNoise | None:
    """Return the discrete noise share the server's round instruction asks for (``dp-discrete``), or ``None``.

    Read from the instruction itself, not from what the wrapped ClientApp
    answers: a task or app that forgets to ask for noise cannot skip it.
    """
    settings = message.content.get("config")
    if not isinstance(settings, ConfigRecord) or QUORUM_WIRE not in settings:
        return None
    try:
        dp = ClientDPConfig.from_config(TrainConfig.from_record(settings))
    except (TypeError, ValueError) as exc:  # DPConfigError is a ValueError
        raise SecAggError(f"the round's DP settings are malformed: {exc}") from exc
    return dp.grid_noise() if dp is not None else None


def _update_of(content: RecordDict) -> tuple[np.ndarray, float]:
    update = record_of(content, UPDATE_RECORD, ArrayRecord)
    metrics = record_of(content, METRICS_RECORD, MetricRecord)
    try:
        if update is None or metrics is None:
            raise KeyError(UPDATE_RECORD if update is None else METRICS_RECORD)
        delta = ndarray_of(update[UPDATE_KEY])
        # A client may override its weight (DP-FedAvg: every client weighs 1).
        weight = _number(metrics.get(OVERRIDE_WEIGHT_KEY, metrics[WEIGHT_KEY]))
    except (KeyError, TypeError, ValueError) as exc:
        raise SecAggError("the training reply lacks update/delta or metrics/num-examples") from exc
    return np.asarray(delta).reshape(-1), weight


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _error(message: Message, exc: BaseException) -> Message:
    return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"secagg: {type(exc).__name__}: {exc}"),
                   reply_to=message)


def secagg_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Answer secure-aggregation stages; everything else goes to ``call_next``.

    Parameters
    ----------
    message : Message
        The incoming message.
    context : Context
        The node's context; the round's protocol state lives in
        ``context.state`` under ``"secagg.state"``.
    call_next : ClientAppCallable
        The rest of the ClientApp (training).

    Returns
    -------
    Message
        The stage reply, or an error reply (the server counts it a dropout).
    """
    if not message.has_content() or record_of(message.content, RECORD, ConfigRecord) is None:
        return call_next(message, context)
    kept: dict[str, RecordDict] = {}

    def train() -> tuple[np.ndarray, float, GridNoise | None]:
        noise = _instructed_noise(message)
        out = call_next(message, context)
        if out.has_error():
            raise _TrainingFailed(out)
        metrics = record_of(out.content, METRICS_RECORD, MetricRecord)
        if metrics is not None and metrics_wanted(message.content):
            kept["metrics"] = RecordDict({METRICS_RECORD: metrics})
        return (*_update_of(out.content), noise)

    try:
        stage, round_id, request = read_request(message.content)
        state = None if stage is Stage.ADVERTISE_KEYS else _load_state(context, round_id)
        state, reply = client_step(state, message.metadata.dst_node_id, request, entropy=os.urandom,
                                   rng=np.random.default_rng(), train=train,
                                   policy=policy_from_node_config(context.node_config))
    except _TrainingFailed as failed:
        return Message(failed.reply.error, reply_to=message)
    except (SecAggError, ValueError) as exc:
        return _error(message, exc)
    _save_state(context, round_id, state)
    return Message(reply_content(stage, round_id, reply, kept.get("metrics")), reply_to=message)
