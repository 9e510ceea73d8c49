"""Worker processes for the in-process runtime: every core runs clients.

A :class:`WorkerPool` forks ``workers`` processes once, when the first
message is pushed (after the aggregator has loaded its data, so the forked
workers share those pages). Each worker keeps what the ClientApp caches per
process (the task, the data set's partition index, one model) and reuses it
across clients and rounds; a node's own state travels with each call (its
``Context``: node config and ``state``), so any worker can serve any node and
the aggregator process stays the one owner of every node's context.

Each worker runs torch on ``threads`` intra-op threads (default: the cores
divided among the workers). Torch's results depend on that number (a
reduction split over two threads adds in another order), so a run is
bit-identical to the one-process run at the same threads per client.

Messages cross a worker's pipe pickled (both ends are this program, one
forked from the other): records arrive with the values Flower checked when
they were built, arrays with their exact bytes, at about a third of the cost
of Flower's protobuf form. A round's instruction (one content object pushed
to every node) crosses once per worker; later calls carry only its metadata.
"""

from __future__ import annotations

import contextlib
import gc
import io
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from flwr.app import Array, Context, Error, Message, RecordDict
from flwr.app.message import make_message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

__all__ = ["WorkerPool", "default_workers", "call_app"]

#: Seconds a worker has to exit after being asked, before it is terminated.
_STOP_GRACE_S = 5.0
#: How often an idle worker checks that the aggregator's process is still its parent.
_PARENT_CHECK_S = 1.0


def default_workers() -> int:
    """One worker per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def call_app(app: ClientApp, message: Message, context: Context) -> Message:
    """Run the ClientApp; an exception becomes the error reply a SuperNode would send."""
    try:
        return app(message, context)
    except Exception as exc:
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(exc).__name__}: {exc}"),
                       reply_to=message)


def _serve(app: ClientApp, conn: Connection, threads: int, inherited: list[Connection]) -> None:
    """Serve calls in a worker: (message, context) in, (reply, the context's new state) out, until an empty job.

    Ctrl-C reaches the whole process group: a worker ignores it and lets the
    aggregator's process end the run and close the pool. A worker whose
    aggregator died (killed, even with SIGKILL) notices within a second and exits.
    """
    import torch

    for other in inherited:  # the pool's ends of earlier workers' pipes: holding them would hide their EOF
        other.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    parent = os.getppid()
    held: RecordDict | None = None  # the last instruction's content, as decoded
    while True:
        try:
            while not conn.poll(_PARENT_CHECK_S):
                if os.getppid() != parent:
                    return
            job = conn.recv_bytes()
        except (EOFError, OSError):  # the aggregator's process is gone
            return
        if not job:
            return
        message, context = pickle.loads(job)
        if isinstance(message, Message):
            if message.has_content():  # a copy taken before the app runs: what the app does to its own stays there
                held = _fresh(message.content)
            reply = call_app(app, message, context)
        else:  # the round's instruction, unpickled here before: only its metadata came
            message = make_message(metadata=message, content=_fresh(held or RecordDict()))
            reply = call_app(app, message, context) if held is not None else Message(
                Error(code=1, reason="client worker: the instruction it was to reuse never reached it"),
                reply_to=message)
        conn.send_bytes(_answer(message, reply, context))


def _answer(message: Message, reply: Message, context: Context) -> bytes:
    """Pickle the reply and the node's new state.

    A reply that cannot be pickled (an object the app slipped past Flower's
    checks) becomes an error reply, with ``None`` for "the state stays as it was".
    """
    try:
        return _dumps((reply, context.state))
    except Exception as exc:  # whatever the app put in its reply, the worker lives on
        reason = f"client worker: the reply cannot reach the aggregator ({type(exc).__name__}: {exc})"
        error = Error(code=1, reason=reason)
        return _dumps((Message(error, reply_to=message), None))


class _Worker:
    def __init__(self, ctx: Any, app: ClientApp, threads: int, siblings: list[_Worker]) -> None:
        self.conn, child = ctx.Pipe()
        inherited = [self.conn, *(s.conn for s in siblings)]
        self.process = ctx.Process(target=_serve, args=(app, child, threads, inherited), daemon=True,
                                   name="quorum-client-worker")
        self.process.start()
        child.close()
        self.held: Any = None  # the content the worker holds decoded

    def call(self, message: Message, context: Context) -> tuple[Message, RecordDict | None]:
        """Make one call on this worker; return the reply and the node's new state.

        A round's instruction (one content object pushed to every node) crosses
        the pipe once per worker; later calls send only their metadata (the
        worker reuses what it decoded).
        """
        content = message.content if message.has_content() and not message.has_error() else None
        reuse = content is not None and content is self.held
        self.conn.send_bytes(_dumps((message.metadata if reuse else message, context)))
        if content is not None:
            self.held = content  # kept alive, so its id is never another object's
        reply, state = pickle.loads(self.conn.recv_bytes())
        return reply, state

    def ask_to_stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send_bytes(b"")

    def stop(self) -> None:
        self.ask_to_stop()
        self.process.join(_STOP_GRACE_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_STOP_GRACE_S)
        with contextlib.suppress(OSError):  # a call thread that saw the worker die may be closing it too
            self.conn.close()


class WorkerPool:
    """``workers`` forked processes that run ``app`` for any node; thread-safe, one call per worker at a time.

    Parameters
    ----------
    app : ClientApp
        The app every worker runs (inherited by fork, never pickled).
    workers : int
        How many processes.
    threads : int | None
        Torch intra-op threads per worker; default: the cores divided among the workers.
    """

    def __init__(self, app: ClientApp, workers: int, threads: int | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._app, self.workers = app, workers
        self.threads = threads or max(1, default_workers() // workers)
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Fork the workers, once (idempotent).

        The grid calls it from the thread that pushes, before any of its own
        call threads exist.
        """
        with self._lock:
            if self._all or self._closed:
                return
            # (building a torch.optim optimiser imports torch's compiler stack, 2-3 s: Quorum's own training
            # does not use one (learning.training), so it is not imported here ahead of the fork; a task that
            # does pays it once per worker)
            ctx = mp.get_context("fork")  # workers inherit the loaded data and the app; nothing is pickled
            # Frozen objects are skipped by the collector: a worker's garbage collection would otherwise
            # touch every inherited object (10,000 node contexts) and copy its page
            gc.collect()
            gc.freeze()
            try:
                for _ in range(self.workers):
                    worker = _Worker(ctx, self._app, self.threads, self._all)
                    self._all.append(worker)
                    self._idle.put(worker)
            finally:
                gc.unfreeze()

    def call(self, message: Message, context: Context) -> Message:
        """Run the app for ``message`` on an idle worker; ``context.state`` takes the node's new state.

        A worker that dies mid-call (killed, out of memory) is replaced, and the
        call answers with an error reply naming its exit code.
        """
        self.start()
        worker = self._idle.get()
        try:
            reply, state = worker.call(message, context)
        except (EOFError, OSError):
            worker.process.join(_STOP_GRACE_S)
            code = worker.process.exitcode
            worker = self._replace(worker)
            # the client's process is gone (killed, out of memory): a client that did not answer, as Flower's
            # SuperNode reports a ClientApp process that died
            return Message(Error(code=ErrorCode.CLIENT_APP_CRASHED,
                                 reason=f"client worker process died (exit code {code})"), reply_to=message)
        finally:
            self._idle.put(worker)
        # None: the reply could not be sent, and the node's state stays as it was; an empty state stays the
        # node's own empty one (a fresh copy per call would cost 100,000 nodes 25 MB)
        if state is not None and (len(state) or len(context.state)):
            context.state = state
        return reply

    def _replace(self, dead: _Worker) -> _Worker:
        with self._lock:
            if self._closed or dead not in self._all:  # the pool is closing: close() stops every worker
                return dead
            dead.stop()
            others = [w for w in self._all if w is not dead]
            fresh = _Worker(mp.get_context("fork"), self._app, self.threads, others)
            self._all[self._all.index(dead)] = fresh
            return fresh

    def close(self) -> None:
        """Ask every worker to exit, then wait for them against one deadline (a busy one finishes its call)."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for worker in workers:
            worker.ask_to_stop()
        for worker in workers:
            worker.stop()


def _array(dtype: str, shape: tuple[int, ...], stype: str, data: bytes) -> Array:
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


def _reduce_array(array: Array) -> tuple[Any, tuple[Any, ...]]:
    return _array, (array.dtype, tuple(array.shape), array.stype, bytes(array.data))


class _Pickler(pickle.Pickler):
    """Pickle with one addition: a Flower ``Array``, or a subclass's, travels as its bytes.

    Its data may be a memoryview, which does not pickle.
    """

    def reducer_override(self, obj: Any) -> Any:
        return _reduce_array(obj) if isinstance(obj, Array) else NotImplemented


def _dumps(obj: Any) -> bytes:
    """Pickle what crosses a worker's pipe: Flower's own objects.

    Both ends are this program, forked; records keep their checked values and
    arrays their exact bytes, at a third of protobuf's cost.
    """
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _fresh(content: RecordDict) -> RecordDict:
    """Return a copy of ``content``: new records, lists and ``Array`` objects over the same immutable values.

    The values shared are arrays' bytes, numbers and strings; a record under
    two names (the legacy aliases) stays one record.
    """
    copies: dict[int, Any] = {}
    out = RecordDict()
    record: Any
    for key, record in content.items():
        if id(record) not in copies:  # an app may change a config list in place, or an array's attributes
            copy = copies[id(record)] = record.copy()  # Flower's copy: the values were checked when they came
            for k, v in record.items():
                if isinstance(v, list):
                    copy[k] = list(v)
                elif isinstance(v, Array):
                    copy[k] = Array(dtype=v.dtype, shape=tuple(v.shape), stype=v.stype, data=v.data)
        out[key] = copies[id(record)]
    return out
