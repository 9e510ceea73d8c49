"""The messages between aggregator and clients, as typed dataclasses.

Flower carries ``RecordDict`` s; this module, with the two halves it
re-exports, is the one place that knows how a Quorum instruction or reply is
laid out in one, so both sides import it. A Quorum update travels as one flat
float32 ``Array`` (numpy ``.npy`` bytes, never pickle). Replies are decoded without copying and validated before
anything touches the running aggregate: a malformed reply raises
:class:`~core.errors.UpdateRejected` naming the problem.

Flower compatibility, both ways (:class:`Wire`). An instruction carries the
global model once, as ``arrays``: an ``ArrayRecord`` shaped like the model's
``state_dict`` (:mod:`core.layouts`), with the settings in ``config``; the
legacy names ``fitins.*`` / ``evaluateins.*`` point at the same two records
(Flower's wire is content-addressed, so an alias costs a reference, not the
model again). Quorum's ``config`` carries ``quorum-wire``: Quorum's client
answers such an instruction with a delta (``update``), and any other in the
layout it was addressed in. Replies are told apart per reply: a delta named
``update`` (Quorum), full weights in ``arrays`` (a Flower message-API client,
turned into a delta against the global model sent, one copy) or
``fitres.parameters`` (a legacy ``NumPyClient``).

The code lives in the two halves: :mod:`core.instructions` (what the
aggregator sends, read on the client) and :mod:`core.replies` (what a client
answers, validated on the aggregator); this module re-exports them and the
size measures of :mod:`core.wire`. Import every name from here; no module
outside these three spells a message key.
"""

from __future__ import annotations

from core.eval_replies import ACCURACY_NAMES, LOSS_NAMES, EvalReply, eval_reply, parse_eval_reply
from core.instructions import (
    DOWNLINK_BITS,
    QUORUM_WIRE,
    SCAFFOLD_CONTROL,
    Instruction,
    TrainConfig,
    Wire,
    broadcast_of,
    client_seed,
    control_of,
    evaluate_instruction,
    parse_instruction,
    read_instruction,
    train_instruction,
    with_control,
)
from core.replies import (
    MAX_EXAMPLES,
    MAX_KEY_CHARS,
    MAX_LOSS,
    MAX_METRIC_VALUE,
    MAX_METRICS,
    TrainReply,
    clean_metrics,
    decode_flat,
    encode_flat,
    parse_train_reply,
    train_reply,
)
from core.wire import content_bytes, wire_bytes

__all__ = [
    "TrainConfig", "TrainReply", "EvalReply", "encode_flat", "decode_flat",
    "train_instruction", "parse_instruction", "train_reply", "parse_train_reply",
    "eval_reply", "parse_eval_reply", "content_bytes", "wire_bytes", "DOWNLINK_BITS", "broadcast_of", "client_seed",
    "clean_metrics", "MAX_EXAMPLES", "MAX_LOSS", "LOSS_NAMES", "ACCURACY_NAMES",
    "Wire", "Instruction", "read_instruction", "evaluate_instruction",
    "QUORUM_WIRE", "SCAFFOLD_CONTROL", "with_control", "control_of",
    # the bounds on a reply's metrics (core.replies, with the rest of the reply code)
    "MAX_METRICS", "MAX_METRIC_VALUE", "MAX_KEY_CHARS",
]
