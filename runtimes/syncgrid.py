"""A synchronous in-process ``Grid``: a pushed message runs the ClientApp at once.

The protocol tests and the secure-aggregation benchmark drive Quorum's and
Flower's workflows over this one grid, so every protocol pays the same
transport cost (none) and the same per-stage accounting: seconds spent in
clients and bytes sent up, by stage. ``drop(message)`` makes a node vanish
before it answers; ``node_configs`` gives nodes their node config (e.g. the
secure-aggregation identities of :func:`privacy.secagg.identity.node_config`).
"""

from __future__ import annotations

import copy
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.app.message import make_message
from flwr.clientapp import ClientApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from runtimes.inprocess import LocalGrid

__all__ = ["SyncGrid", "content_size", "stage_name"]

SERVER_NODE = 0


def content_size(content: RecordDict) -> int:
    """Payload bytes of a RecordDict: array data, bytes/str values, 8 per number."""
    total = 0
    for record in content.values():  # not .config_records: that view rebuilds every record
        if isinstance(record, ArrayRecord):
            total += sum(len(a.data) for a in record.values())
            continue
        for value in record.values():
            items = value if isinstance(value, list) else [value]
            total += sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in items)
    return total


def stage_name(message: Message) -> str:
    """Return the protocol stage a message is for (ours or Flower's), else its type."""
    for record in message.content.values():
        if isinstance(record, ConfigRecord) and isinstance(record.get("stage"), str):
            return str(record["stage"])
    return message.metadata.message_type


_Record = ArrayRecord | MetricRecord | ConfigRecord


def _copied(message: Message) -> Message:
    """Return a node's own copy of the records (Flower's secaggplus_mod mutates them); arrays shared."""
    def copy_record(record: _Record) -> _Record:
        if isinstance(record, ArrayRecord):
            return ArrayRecord(dict(record.items()))
        if isinstance(record, MetricRecord):
            return MetricRecord({k: v.copy() if isinstance(v, list) else v for k, v in record.items()})
        return ConfigRecord({k: v.copy() if isinstance(v, list) else v for k, v in record.items()})

    content = RecordDict({k: copy_record(r) for k, r in message.content.items()})
    return make_message(metadata=copy.copy(message.metadata), content=content)


class SyncGrid(LocalGrid):
    """In-process ``Grid``: a pushed message runs the ClientApp at once, unless ``drop(message)``."""

    def __init__(self, app: ClientApp, node_ids: Iterable[int],
                 drop: Callable[[Message], bool] = lambda _: False, run_id: int = 1,
                 node_configs: Mapping[int, Mapping[str, str]] | None = None) -> None:
        # Flower reads these when building a Message; a runtime would set them.
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SERVER_NODE, 1
        self._run = Run.create_empty(run_id)
        self._app, self._drop = app, drop
        configs = node_configs or {}
        self._contexts = {n: Context(run_id, n, dict(configs.get(n, {})), RecordDict(), {}) for n in node_ids}
        self._replies: dict[str, Message] = {}
        self.client_seconds: dict[str, float] = defaultdict(float)  # per stage name
        self.bytes_up: dict[str, int] = defaultdict(int)

    def _call(self, message: Message) -> Message:
        stage = stage_name(message)
        start = time.perf_counter()
        try:
            reply = self._app(message, self._contexts[message.metadata.dst_node_id])
        except Exception as exc:
            reply = Message(Error(2, f"{type(exc).__name__}: {exc}"), reply_to=message)
        self.client_seconds[stage] += time.perf_counter() - start
        self.bytes_up[stage] += content_size(reply.content) if reply.has_content() else 0
        reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        return reply

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Give each message an id and run the ClientApp on it now, unless ``drop``; return the ids.

        Each call gets its own copy of the records; an exception the app
        raises becomes an error reply.
        """
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id
            ids.append(message_id)
            if not self._drop(message):
                self._replies[message_id] = self._call(_copied(message))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Return the replies to ``message_ids`` not yet pulled; each is returned once."""
        return [self._replies.pop(m) for m in message_ids if m in self._replies]

    def settled(self, message_ids: Iterable[str]) -> bool:
        """Return True when none of ``message_ids`` can still be answered (all ran at push)."""
        return not any(m in self._replies for m in message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:  # noqa: ARG002 (Grid's signature)
        """Push ``messages`` and return their replies (all ran at push; ``timeout`` is not needed)."""
        return self.pull_messages(list(self.push_messages(messages)))
