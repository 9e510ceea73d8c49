"""Quorum's ClientApp, with a training delay read from the node's config (``delay-s``): a slow device."""

from __future__ import annotations

import time

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from clients.clientapp import client_mods, evaluate_handler, train_handler


def slow_device(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Sleep ``delay-s`` seconds before training (the node's config; 0 when unset)."""
    delay = float(context.node_config.get("delay-s", 0))
    if delay > 0 and message.metadata.message_type.startswith("train"):
        time.sleep(delay)
    return call_next(message, context)


app = ClientApp(mods=[slow_device, *client_mods()])
app.train()(train_handler)
app.evaluate()(evaluate_handler)
