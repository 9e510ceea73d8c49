"""An edge aggregator's upstream ClientApp: hand the aggregator's messages to the edge's ServerApp.

A node whose node config names an ``edge-channel`` folder is an edge
aggregator (``quorum aggregator start --edge``): towards the aggregator it is
one client. The messages meant for an edge (``core.partials``: the round's
instruction for its devices, the evaluation's, the question which devices
are under it) are handed over that folder (:class:`core.channel.Channel`) to
the edge's own ServerApp, which runs them over its devices; its answer is
the reply. Nothing of a device's ClientApp (its data, its mods) runs here.

:func:`edge_mod` is the ClientApp's outermost mod: an edge's messages never
reach a device's mods. A node that is no edge refuses them (it has no
devices to ask).
"""

from __future__ import annotations

import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp.typing import ClientAppCallable

from core.channel import Channel
from core.partials import EDGE_EVALUATE, EDGE_QUERY, EDGE_TRAIN

__all__ = ["edge_mod", "forward", "EDGE_CHANNEL", "EDGE_TYPES"]

#: The node config key naming an edge's hand-off folder (``quorum aggregator start --edge`` sets it).
EDGE_CHANNEL = "edge-channel"
EDGE_TYPES = frozenset({EDGE_TRAIN, EDGE_EVALUATE, EDGE_QUERY})
#: What of the aggregator's run config an edge keeps: the scenario. Not its store's address, its devices' names
#: or who submitted the run.
SCENARIO_KEYS = frozenset({"scenario-json", "overrides"})
#: How long an edge waits for its ServerApp when the message's own time to live says nothing (seconds).
DEFAULT_WAIT_S = 600.0


def forward(message: Message, context: Context) -> Message:
    """Hand ``message`` to this edge's ServerApp and reply with its answer.

    It waits as long as the message lives (its time to live, from when the
    aggregator created it; the whole time to live when the two hosts' clocks
    disagree so much that the message looks expired or not yet created).

    Raises
    ------
    ValueError
        This node is no edge aggregator (its node config has no ``edge-channel``).
    core.errors.EdgeUnavailable
        The edge's ServerApp did not answer in time.
    """
    folder = context.node_config.get(EDGE_CHANNEL)
    if not isinstance(folder, str) or not folder:
        raise ValueError(f"a {message.metadata.message_type} message reached a device: only an edge aggregator "
                         f"(node config {EDGE_CHANNEL}) answers it")
    meta = message.metadata
    ttl = float(meta.ttl) if meta.ttl and meta.ttl > 0 else DEFAULT_WAIT_S
    wait = meta.created_at + ttl - time.time()  # the aggregator's clock: on another host it may be off
    if not 1.0 <= wait <= ttl:  # created in the future, or expired on arrival: clocks disagree; trust the TTL
        wait = ttl
    scenario = {k: v for k, v in context.run_config.items() if k in SCENARIO_KEYS}  # never the aggregator's store
    answer = Channel(Path(folder)).ask(context.run_id, meta.message_type, message.content, wait, run_config=scenario)
    return Message(answer, reply_to=message)


def edge_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Answer an edge's messages by :func:`forward`; pass every other message on to the device's mods."""
    if message.metadata.message_type in EDGE_TYPES:
        return forward(message, context)
    return call_next(message, context)
