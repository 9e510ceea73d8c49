"""The ClientApp's features as Flower mods: standardisation, DP on the update, its compression.

Each mod wraps the training handler (``clients.clientapp``): it reads the
round's settings from Quorum's instruction (:func:`core.instructions.quorum_settings`),
lets the rest of the app train, then rewrites its own node's update in the
reply. The handler only trains through the task. In order of composition,
innermost first (``clients.clientapp.client_mods``):

0. :func:`standardize_mod`: the node's data standardised as the instruction
   says (``[data] standardize``), for training and evaluation alike: the
   handlers read the node's data through ``DATA_VIEW_KEY``;
1. :func:`dp_mod`: client-level DP (``[dp]``): clip the update, add this
   client's noise share, and the clip bit of adaptive clipping;
2. :func:`compression_mod`: the round's codec (``[compression]``), with the
   error-feedback residual kept in the node's state;
3. :class:`StatisticsMod`: answers ``[data] standardize = "federated"``'s
   statistics passes from the node's features itself, so neither training,
   DP nor compression touches them;
4. the attack harness (``[faults] byzantine``, :class:`clients.attacks.AttackMod`);
5. secure aggregation (``privacy.secagg.flower_mod.secagg_mod``), which masks
   what the mods inside it made.

A message that is not one of Quorum's instructions, or a round without
the feature, passes through untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from core.compress import Codec, with_feedback
from core.errors import UpdateRejected
from core.instructions import DP_DISCRETE, STD_LIMIT, STD_MEAN, STD_PASS, STD_SCALES, TrainConfig, quorum_settings
from core.replies import own_update, rewrite_update, train_reply
from learning.standardize import Standardization, asks_for_statistics, statistics_vector
from privacy.dp.mechanisms import ClientDPConfig, client_payload
from privacy.dp.rng import secure_rng
from privacy.secagg.flower_records import RECORD

__all__ = ["standardize_mod", "dp_mod", "compression_mod", "StatisticsMod", "RESIDUAL_KEY", "DATA_VIEW_KEY",
           "data_view"]

#: Where a node keeps its error-feedback residual between rounds (``context.state``).
RESIDUAL_KEY = "quorum.residual"


#: Where :func:`standardize_mod` leaves this message's standardisation for the handlers (``context.state``,
#: removed when the message is answered): the mean and std, as a run stores them.
DATA_VIEW_KEY = "quorum.standardize"


def standardize_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Hand the handlers the node's data standardised as the instruction says (``[data] standardize``).

    Every train and evaluate instruction of a run with federated
    standardisation carries the features' mean and std; the handlers read the
    node's data through :func:`data_view`, which applies them. A message
    without them leaves no view behind, whatever an earlier one left.

    Raises
    ------
    UpdateRejected
        The instruction's standardisation is malformed (the reason says how).
    """
    context.state.pop(DATA_VIEW_KEY, None)
    config = quorum_settings(message.content) if message.has_content() else None  # UpdateRejected: a bad setting
    try:
        found = None if config is None else Standardization.from_config(config)
    except ValueError as exc:
        raise UpdateRejected(str(exc)) from None
    if found is None:
        return call_next(message, context)
    view: dict[str, Any] = dict(found.to_info())
    context.state[DATA_VIEW_KEY] = ConfigRecord(view)
    try:
        return call_next(message, context)
    finally:
        context.state.pop(DATA_VIEW_KEY, None)


def data_view(state: RecordDict) -> Standardization | None:
    """Return the standardisation :func:`standardize_mod` left for this message in the node's ``state``, or ``None``."""
    kept = state.get(DATA_VIEW_KEY)
    return Standardization.from_info(dict(kept)) if isinstance(kept, ConfigRecord) else None


def _settings(message: Message) -> TrainConfig | None:
    if message.metadata.message_type != "train" or not message.has_content():
        return None
    return quorum_settings(message.content)


def dp_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Apply client-level DP to the update the rest of the app trained: clip, add the noise share, the clip bit.

    The noise is this client's share (distributed placement); the bit is the
    centred clip bit (adaptive clipping). Nothing about the norm goes into the
    metrics: it would leak. Under secure aggregation every client weighs 1, as
    DP-FedAvg's fixed denominator requires (``secagg-weight``). A round that
    asks for discrete noise, which only secure aggregation adds on its grid
    (``privacy.dp.discrete``), is refused unmasked before any training.

    Raises
    ------
    UpdateRejected
        The round asks for discrete DP noise and the message carries no secure aggregation.
    """
    config = _settings(message)
    if config is None:
        return call_next(message, context)
    if config.get(DP_DISCRETE) and RECORD not in message.content:
        raise UpdateRejected("the round asks for discrete DP noise, which only secure aggregation adds "
                             "(on its grid): refusing to send the update unmasked and un-noised")
    dp = ClientDPConfig.from_config(config)
    out = call_next(message, context)
    delta = None if dp is None or out.has_error() else own_update(out.content)
    if dp is None or delta is None:
        return out
    noised = client_payload(delta, dp, secure_rng()).astype(np.float32, copy=False)
    rewrite_update(out.content, delta=noised, metrics={"secagg-weight": 1.0})
    return out


def compression_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Encode the update the way the round asks (``[compression]``, :mod:`core.compress`), after DP's clip.

    Under secure aggregation only shared-seed random-k applies: the kept
    values travel as a dense vector that the protocol masks (every client
    keeps the same coordinates, so the masks cancel). Elsewhere the codec's
    arrays replace the delta. The error-feedback residual stays in the node's
    state (``context.state``), which a device's agent keeps across rounds.

    Raises
    ------
    UpdateRejected
        Top-k or quantisation asked for under secure aggregation (refused before any training).
    """
    config = _settings(message)
    codec = None if config is None else Codec.from_config(config)
    if config is None or codec is None:
        return call_next(message, context)
    secure = RECORD in message.content
    if secure and (codec.topk or codec.bits != 32):
        raise UpdateRejected("under secure aggregation only random-k compression applies (top-k supports differ "
                             "per client, and the protocol quantises on its own grid)")
    out = call_next(message, context)
    delta = None if out.has_error() else own_update(out.content)
    if delta is None:
        return out
    kept = context.state.get(RESIDUAL_KEY)
    residual = kept["residual"].numpy() if isinstance(kept, ArrayRecord) and "residual" in kept else None
    if secure:
        values, left = codec.select(delta, residual)
        rewrite_update(out.content, delta=values)
    else:
        # stochastic rounding's draws: from the round and node, so a run is reproducible from its seed
        rng = np.random.default_rng([config.seed, config.round, context.node_id, 0xC0DE])
        arrays, left = with_feedback(codec, delta, residual, rng)
        rewrite_update(out.content, compressed=arrays)
    if left is not None:
        context.state[RESIDUAL_KEY] = ArrayRecord({"residual": Array(left.astype(np.float32, copy=False))})
    return out


class StatisticsMod:
    """Answer ``[data] standardize = "federated"``'s statistics passes; every other message goes on.

    ``features_of(context)`` is the node's training data (with its features as
    ``x``). A pass's answer is :func:`learning.standardize.statistics_vector`
    of them, weighted by the node's row count.
    """

    def __init__(self, features_of: Callable[[Context], Any]) -> None:
        self.features_of = features_of

    def __call__(self, message: Message, context: Context, call_next: ClientAppCallable) -> Message:
        """Answer a statistics pass from the node's features, or hand the message on.

        Raises
        ------
        UpdateRejected
            The task's data have no feature arrays, or the pass's settings are not usable.
        """
        if message.metadata.message_type != "train" or not message.has_content() \
                or not asks_for_statistics(message.content):
            return call_next(message, context)
        train = self.features_of(context)
        if not hasattr(train, "x"):
            raise UpdateRejected("data.standardize = \"federated\" needs feature arrays; this task's data have none")
        try:
            config = TrainConfig.from_record(message.content.config_records["config"])
            limit = config.get(STD_LIMIT)
            vector = statistics_vector(train.x, str(config.get(STD_PASS)), _positive(1.0 if limit is None else limit),
                                       config.get(STD_SCALES), config.get(STD_MEAN))
        except ValueError as exc:
            raise UpdateRejected(f"statistics pass: {exc}") from None
        return Message(train_reply(vector, int(train.x.shape[0]), {}), reply_to=message)


def _positive(limit: float) -> float:
    if not 0 < limit < 1e30:
        raise UpdateRejected(f"statistics pass: {STD_LIMIT.key} = {limit!r} is not a positive number")
    return limit
