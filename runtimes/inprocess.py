"""Quorum's in-process runtime: a Flower ``Grid`` that calls the ClientApp directly.

Flower ships no runtime without Ray or a SuperLink, so this is the embedded
default used by ``quorum simulate``, the scenarios and the tests: the very same
ServerApp logic and ClientApp run, messages are real Flower ``Message`` s, and
one worker thread executes client calls so the aggregator can poll, enforce
deadlines and fold replies as they arrive. With ``workers > 1`` the calls run
on a :class:`runtimes.pool.WorkerPool` of forked processes, one call per worker
at a time; replies are handed out in the order the messages were pushed (a
reply waits only while an earlier message is still running), so the
aggregate folds in the same order, and gives the same bits, as on one worker.
Faults from the scenario (clients that vanish at a stage, stragglers, corrupt
replies) are injected here, at the transport, so neither the round loop nor
the ClientApp carries fault code.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from runtimes.faults import FaultPlan
from runtimes.pool import WorkerPool, call_app

__all__ = ["InProcessGrid", "LocalGrid", "NodeSpec"]

SERVER_NODE_ID = 0
#: Stripes of the per-node call lock: two nodes share one with odds 1 in this many.
_NODE_LOCKS = 256


@dataclass(frozen=True)
class NodeSpec:
    """One virtual SuperNode: its id and its node config (e.g. partition-id)."""

    node_id: int
    config: Mapping[str, int | float | str | bool] = field(default_factory=dict)


class LocalGrid(Grid):
    """Share what every grid whose nodes live in this process needs.

    That is the run and its node contexts (``self._run``,
    ``self._contexts``), and plain message creation.
    """

    _run: Run
    _contexts: dict[int, Context]

    def set_run(self, run: Run) -> None:
        """Set the Flower run the grid serves."""
        self._run = run

    @property
    def run(self) -> Run:
        """Return the Flower run the grid serves."""
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """Return a new message of ``message_type`` carrying ``content`` to node ``dst_node_id``."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Return the ids of every node, in the order they were given."""
        return list(self._contexts)


class InProcessGrid(LocalGrid):
    """A ``Grid`` whose nodes are ClientApp calls in this process.

    Parameters
    ----------
    client_app : ClientApp
        The app every node runs.
    nodes : Iterable[NodeSpec]
        The virtual nodes.
    run_config : Mapping
        The run config every node's ``Context`` sees.
    faults : FaultPlan | None
        Which messages vanish, arrive late or arrive corrupted.
    run_id : int
        The Flower run id to stamp on messages.
    workers : int
        Client calls at a time: 1 runs them on a thread of this process; more
        run them on that many forked worker processes.
    threads : int | None
        Torch intra-op threads per worker process (default: cores / workers);
        with one worker, when given, this process's torch threads.
    """

    #: Its push and pull may be called from several threads at once (simulated edge aggregators do).
    thread_safe = True

    def __init__(self, client_app: ClientApp, nodes: Iterable[NodeSpec],
                 run_config: Mapping[str, int | float | str | bool], faults: FaultPlan | None = None,
                 run_id: int = 1, workers: int = 1, threads: int | None = None) -> None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SERVER_NODE_ID, 1
        self._run = Run.create_empty(run_id)
        self._app = client_app
        self._faults = faults or FaultPlan.none()
        shared = dict(run_config)  # one read-only run config for every node (100,000 nodes: 100,000 copies)
        self._contexts = {
            n.node_id: Context(run_id=run_id, node_id=n.node_id, node_config=dict(n.config),
                               state=RecordDict(), run_config=shared)
            for n in nodes
        }
        self._pool = WorkerPool(client_app, workers, threads) if workers > 1 else None
        if self._pool is None and threads is not None:
            import torch

            torch.set_num_threads(threads)  # this process runs the clients
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="quorum-node")
        self._lock = threading.Lock()
        self._pending: dict[str, Future[Message | None]] = {}
        self._seq: dict[str, int] = {}  # push order of pending messages
        # one call per node at a time: a node takes the lock of its stripe (a lock per node costs 100,000 locks)
        self._node_locks = [threading.Lock() for _ in range(_NODE_LOCKS)]
        self._pushed = 0
        self._ready_at: dict[str, float] = {}

    # -- Grid API ---------------------------------------------------------
    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Give each message an id and start its ClientApp call; return the ids, in order.

        A message the fault plan drops gets an id but no call: no reply will
        ever come for it.

        Raises
        ------
        ValueError
            A message is for a node this grid does not have.
        """
        batch = list(messages)
        if self._pool is not None:
            self._pool.start()
        dropped = self._faults.pick_dropped(batch)
        ids = []
        for message in batch:
            if message.metadata.dst_node_id not in self._contexts:
                raise ValueError(f"unknown node id {message.metadata.dst_node_id}")
            message_id = uuid.uuid4().hex
            _set_message_id(message, message_id)
            ids.append(message_id)
            if id(message) in dropped:
                continue  # the node vanished: no reply will ever come
            with self._lock:
                self._pending[message_id] = self._executor.submit(self._handle, message)
                self._seq[message_id], self._pushed = self._pushed, self._pushed + 1
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Return the replies to ``message_ids`` that are ready, in push order; each is returned once.

        A reply is ready when its call is done, no earlier message among those
        asked for is still running, and its straggler delay has passed.
        """
        now = time.monotonic()
        out = []
        asked = list(message_ids)
        with self._lock:
            # a reply waits while an earlier message of those asked for still runs (not one abandoned earlier)
            running = [self._seq[m] for m in asked if m in self._pending and not self._pending[m].done()]
            frontier = min(running, default=self._pushed)
            for message_id in sorted(asked, key=lambda m: self._seq.get(m, -1)):
                future = self._pending.get(message_id)
                if (future is None or not future.done() or self._seq[message_id] > frontier
                        or self._ready_at.get(message_id, 0) > now):
                    continue
                del self._pending[message_id], self._seq[message_id]
                reply = future.result()
                if reply is not None:
                    out.append(reply)
        return out

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and collect their replies until all are in, settled, or ``timeout`` s passed."""
        ids = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while ids and not self.settled(ids) and (deadline is None or time.monotonic() < deadline):
            for reply in self.pull_messages(list(ids)):
                ids.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
            time.sleep(0.002)
        replies.extend(self.pull_messages(list(ids)))
        return replies

    # -- in-process extras ------------------------------------------------
    def expect_cohort(self, server_round: int, stage: str, nodes: Sequence[int]) -> None:
        """Decide which of a round's ``nodes`` vanish at ``stage`` before its messages come in several batches.

        :meth:`runtimes.faults.FaultPlan.expect_cohort`: simulated edge aggregators
        push their devices' messages apart, and lose the devices a flat run would.
        """
        self._faults.expect_cohort(server_round, stage, nodes)

    def lost_edges(self, server_round: int, edges: Sequence[int]) -> frozenset[int]:
        """Return which of a round's simulated edge aggregators vanish (``[faults] edges``)."""
        return self._faults.lost_edges(server_round, edges)

    def settled(self, message_ids: Iterable[str]) -> bool:
        """Return True when none of ``message_ids`` can still produce a reply.

        Only an in-process runtime can know this (a dropped node is gone for
        good); the round loop uses it to close a round early instead of
        waiting for the deadline.
        """
        with self._lock:
            return not any(m in self._pending for m in message_ids)

    def close(self) -> None:
        """Cancel what has not started, stop the workers, then wait for the call threads.

        A call still running in a worker ends as an error reply once its worker is gone.
        """
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._pool is not None:
            self._pool.close()
        self._executor.shutdown(wait=True)

    def __enter__(self) -> InProcessGrid:
        """Return the grid itself; leaving the block closes it."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the grid (:meth:`close`)."""
        self.close()

    def _handle(self, message: Message) -> Message | None:
        node = message.metadata.dst_node_id
        with self._node_locks[node % _NODE_LOCKS]:  # a late call and the next one share the node's state
            context = self._contexts[node]
            try:
                reply = self._pool.call(message, context) if self._pool is not None else call_app(
                    self._app, message, context)
            except Exception as exc:  # the pool itself failed (e.g. no memory to fork a replacement)
                reply = Message(Error(code=1, reason=f"client worker pool: {type(exc).__name__}: {exc}"),
                                reply_to=message)
        _set_message_id(reply, uuid.uuid4().hex)
        delay = self._faults.delay_for(message)
        if delay:
            with self._lock:
                self._ready_at[message.metadata.message_id] = time.monotonic() + delay
        return self._faults.corrupt(message, reply)


def _set_message_id(message: Message, message_id: str) -> None:
    # Flower's Metadata exposes message_id read-only; a SuperLink assigns it
    # the same way, by writing the underlying field.
    message.metadata.__dict__["_message_id"] = message_id
