"""A Flower app's global model, taken from the app itself: no Quorum task needed.

Quorum's ServerApp runs a stock Flower app (``aggregator.flower_app``) with the
app's own model, found in this order:

1. run-config ``initial-arrays = "module:attr"``, when the app declares it: an
   ``ArrayRecord``, a torch ``nn.Module``, a list of numpy arrays, the app's
   ``ServerApp`` (probed, as in 2), or a callable returning one of these;
2. the app's own ServerApp, beside its ClientApp as ``flwr new`` lays an app
   out (``pkg/client_app.py`` -> ``pkg/server_app.py:app``): it is *probed*, run
   against a grid that stops it at its first ``train`` message, whose
   ``ArrayRecord`` is the initial model and whose ``ConfigRecord`` (quickstart-
   pytorch's ``{"lr": 0.1}``) is the train config Quorum then sends every round.
   It runs in a forked process of its own: one that sends nothing within the
   run config's ``first-message-timeout-s`` (300 s), exits with its own code
   (``sys.exit(3)``) or dies is stopped, with whatever it started, and the run
   fails with that reason (:class:`~aggregator.errors.RunFailed`); one that
   raises an exception or returns without a message leaves the model to 3;
3. otherwise the first reply: one node is asked to ``train`` with an empty
   ``ArrayRecord`` (round 0) and its reply's arrays (names, shapes and values)
   are the initial model. A ClientApp that cannot build its model without the
   server's (the official examples' ``load_state_dict`` / ``set_model_params``)
   fails this; the error says how to name the model (1).

The model travels as float32 (``core.layouts``), whatever dtype the app's
arrays have. An integer tensor (a BatchNorm's ``num_batches_tracked``) is
averaged like the rest, as Flower's own ``FedAvg`` averages it, when float32
holds its values exactly (at most 2^24 in size); the app's
``load_state_dict`` casts it back. Any other kind (bool, complex) is refused
by name.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from aggregator.collect import collect, push
from aggregator.errors import AppModelError, RunFailed
from core.boundary import one_line
from core.errors import UpdateRejected
from core.layouts import ParamLayout, gather
from scenarios.flower_app import FIRST_MESSAGE_KEY, first_message_timeout

__all__ = ["AppModel", "model_from_arrays", "initial_model", "first_reply_model", "arrays_of", "INITIAL_ARRAYS"]

#: The run-config key that names a Flower app's initial model (``"module:attr"``).
INITIAL_ARRAYS = "initial-arrays"
#: Train-config keys Quorum sends itself: an app's own value of them is not passed through.
_OURS = ("server-round", "lr")
_PROBE_NODES = 1000  # node ids shown to a probed ServerApp: enough for any min_available_nodes
_FIRST_REPLY_S = 300.0


@dataclass(frozen=True)
class AppModel:
    """A Flower app's global model, as Quorum's round loop starts from it.

    Its initial values (one flat float32 buffer), the tensors' names and shapes
    as they travel, where it came from, and the train config the app's
    ServerApp sends.
    """

    params: np.ndarray
    layout: ParamLayout
    source: str
    lr: float | None = None  # the app's ServerApp's train config "lr", sent as Quorum's lr
    train_config: dict[str, float | int | bool | str] = field(default_factory=dict)  # its other keys


def model_from_arrays(arrays: ArrayRecord, source: str, config: ConfigRecord | None = None) -> AppModel:
    """Return the model in ``arrays`` (any float or integer dtype, C or Fortran order; converted once to float32).

    Raises
    ------
    AppModelError
        No tensor, one neither float nor integer (named), an integer beyond 2^24, or values that are not finite.
    """
    if not isinstance(arrays, ArrayRecord) or not arrays:
        raise AppModelError(f"{source} holds no arrays")
    odd = [(name, a.dtype) for name, a in arrays.items() if _kind(a.dtype) not in "fiu"]
    if odd:
        raise AppModelError(f"{source}: tensor {odd[0][0]!r} is {odd[0][1]}: Quorum averages float and integer "
                            "tensors only")
    layout = ParamLayout(tuple(arrays), tuple(tuple(int(d) for d in a.shape) for a in arrays.values()))
    try:
        params = gather(list(arrays.items()), layout, f"{source}'s arrays")
    except UpdateRejected as exc:
        raise AppModelError(str(exc)) from None
    settings = {k: v for k, v in dict(config or {}).items() if isinstance(v, (int, float, bool, str))}
    lr = settings.pop("lr", None)
    return AppModel(params, layout, source, float(lr) if isinstance(lr, (int, float)) else None,
                    {k: v for k, v in settings.items() if k not in _OURS})


def _kind(dtype: str) -> str:
    """Return numpy's kind letter of a Flower ``Array``'s dtype name (``"?"`` when numpy does not know it)."""
    if str(dtype).startswith("bfloat"):  # no numpy dtype; a float all the same (the payload decides)
        return "f"
    try:
        return np.dtype(dtype).kind
    except TypeError:
        return "?"


def initial_model(grid: Grid, context: Context, own_serverapp: str | None) -> AppModel:
    """Find the app's initial model.

    From its ``initial-arrays`` hook, its own ServerApp (``own_serverapp``,
    ``"module:attr"``, when the app has one), or the first reply.

    Raises
    ------
    AppModelError
        None of them gave a model; the reasons of each are in the message.
    RunFailed
        The app's ServerApp exited with its own code, died, or sent no message in time (it was stopped).
    ScenarioError
        The run config's ``first-message-timeout-s`` is not seconds in (0, a day].
    """
    hook = str(context.run_config.get(INITIAL_ARRAYS, "") or "")
    if hook:
        return _from_object(_load(hook), hook, grid, context)
    tried = []
    if own_serverapp is not None:
        try:
            return _probe(own_serverapp, grid, context)  # imported in the probe's process, under its timeout
        except AppModelError as exc:
            tried.append(str(exc))
    try:
        return first_reply_model(grid)
    except AppModelError as exc:
        tried.append(str(exc))
    raise AppModelError("no initial model for this Flower app: " + "; ".join(tried) + f"; name it with run-config "
                        f"{INITIAL_ARRAYS} = \"module:attr\" (an ArrayRecord, a torch Module, a list of numpy "
                        "arrays, the app's ServerApp, or a function returning one: docs/runtimes.md)")


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in attr.split(".") if attr else ():
            target = getattr(target, part)
    except (Exception, SystemExit) as exc:  # the app's module: whatever its import raises, sys.exit() included
        raise AppModelError(f"{ref} could not be loaded: {one_line(exc)}") from exc
    return target


def _from_object(value: Any, ref: str, grid: Grid, context: Context) -> AppModel:
    """Read an ``initial-arrays`` object as a model.

    The object is an ArrayRecord, a torch Module, numpy arrays, a ServerApp,
    or a zero-argument callable (a class, a factory) returning one of them.
    """
    if isinstance(value, ServerApp):
        return _probe(ref, grid, context, value)
    if isinstance(value, ArrayRecord):
        return model_from_arrays(value, ref)
    if hasattr(value, "state_dict") and not isinstance(value, type):  # a torch Module (torch not imported here)
        return model_from_arrays(ArrayRecord(value.state_dict()), ref)
    if isinstance(value, (list, tuple)) and all(isinstance(a, np.ndarray) for a in value):
        return model_from_arrays(ArrayRecord(list(value)), ref)
    if callable(value):
        try:
            made = value()
        except (Exception, SystemExit) as exc:  # the app's code, sys.exit() included
            raise AppModelError(f"{ref}() raised {one_line(exc)}") from exc
        return _from_object(made, f"{ref}()", grid, context)
    raise AppModelError(f"{ref} is a {type(value).__name__}: expected an ArrayRecord, a torch Module, a list of "
                        "numpy arrays, a ServerApp or a function returning one")


class _FirstMessage(Exception):  # not an error: how the probe stops the app's ServerApp
    def __init__(self, content: RecordDict) -> None:
        super().__init__("the app's first message")
        self.content = content


class _ProbeGrid(Grid):
    """The grid a probed ServerApp runs on: many nodes, and its first message ends it (see :func:`_probe`).

    Built in this process; the probe's own process never talks to the real grid.
    """

    def __init__(self, real: Grid) -> None:
        known = list(real.get_node_ids())
        self._ids = known + [max(known, default=0) + i for i in range(1, _PROBE_NODES - len(known) + 1)]
        try:
            self._run: Any = real.run
        except (TypeError, AttributeError):  # a grid whose run is not set yet (Flower's copy a None run)
            self._run = None

    def set_run(self, run: Any) -> None:
        self._run = run

    @property
    def run(self) -> Any:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        for message in messages:
            raise _FirstMessage(message.content)
        return []

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: ARG002 (Grid's signature)
        return []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:  # noqa: ARG002
        self.push_messages(messages)
        return []


def _probe(ref: str, grid: Grid, context: Context, server_app: ServerApp | None = None) -> AppModel:
    """Run the app's own ServerApp until its first message; that message's arrays and config are the model.

    It runs in a forked process of its own process group (which imports ``ref`` when ``server_app`` is not
    given), given the run config's ``first-message-timeout-s`` to send that message; the process, and
    whatever it started, is stopped once it answered or the time is up, so nothing of the app is left running.

    Raises
    ------
    AppModelError
        It does not import, is no ServerApp, raised an exception, or returned without a message (another
        source may do).
    RunFailed
        It exited with its own code (``sys.exit(3)``), its process died, or it sent nothing in time.
    """
    probe_context = Context(run_id=context.run_id, node_id=context.node_id, node_config=dict(context.node_config),
                            state=RecordDict(), run_config=dict(context.run_config))
    seconds = first_message_timeout(context.run_config)
    kind, value = _run_apart(ref, server_app, _ProbeGrid(grid), probe_context, seconds)
    what = f"the app's ServerApp {ref}"
    if kind == "message":
        return _from_message(value, f"{ref} (the app's own ServerApp, up to its first message)")
    if kind == "unusable":
        raise AppModelError(value)
    if kind == "raised":
        raise AppModelError(f"{what} raised before its first message: {value}")
    if kind == "ended":
        raise AppModelError(f"{what} ended without sending a message")
    if kind == "silent":
        raise RunFailed(f"{what} sent no message in {seconds:g} s and was stopped (give it longer with run config "
                        f"{FIRST_MESSAGE_KEY}, `quorum flower run --first-message-timeout`)")
    raise RunFailed(f"{what} {value} before its first message")


def _run_apart(ref: str, server_app: ServerApp | None, grid: _ProbeGrid, context: Context,
               seconds: float) -> tuple[str, Any]:
    """Run the ServerApp in a forked process; how it went (:func:`_probe_process`'s answer, ``silent``, ``died``).

    Forked, not spawned: what the app's modules import that is imported here already is not imported again.
    """
    ctx = mp.get_context("fork")
    answers, sender = ctx.Pipe(duplex=False)
    # not daemonic: the app's ServerApp may start processes of its own (a DataLoader's workers)
    process = ctx.Process(target=_probe_process, args=(ref, server_app, grid, context, sender))
    try:
        process.start()
    except OSError as exc:  # no process to be had (memory, a process limit)
        answers.close()
        raise AppModelError(f"no process to run the app's ServerApp in: {one_line(exc)}") from exc
    finally:
        sender.close()  # the child's end only: when the child ends, its answers end
    try:
        if not answers.poll(seconds):
            return "silent", None
        with contextlib.suppress(EOFError):  # it ended its process without an answer (os._exit, a signal)
            answer: tuple[str, Any] = answers.recv()
            return answer
    finally:
        answers.close()
        if process.pid is not None:  # set by start(); never 0, which would be this process's own group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # its process group: whatever the app started too
        process.kill()  # in case it had not made its group yet
        process.join()
    return "died", _ended(process.exitcode)


def _probe_process(ref: str, server_app: ServerApp | None, grid: _ProbeGrid, context: Context,
                   answers: Connection) -> None:
    """Run the probed ServerApp (in its own process and process group) and send back how it went.

    ``server_app`` is imported from ``ref`` here when not given, so an import that hangs is under the timeout too.

    Flower's log is held at WARNING here: the probed strategy's "Starting FedAvg" and "Sampled 1000 nodes"
    lines describe no real round.
    """
    os.setpgid(0, 0)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    answer: tuple[str, Any]
    try:
        app = _load(ref) if server_app is None else server_app
        if not isinstance(app, ServerApp):
            raise AppModelError(f"{ref} is a {type(app).__name__}, not a Flower ServerApp")
        app(grid=grid, context=context)
        answer = ("ended", None)
    except AppModelError as exc:  # it does not import, or is something else
        answer = ("unusable", str(exc))
    except _FirstMessage as first:
        answer = ("message", _portable(first.content))
    except SystemExit as exc:  # sys.exit(): the app's own exit code; 0 or None is a plain return
        answer = ("ended", None) if exc.code in (None, 0) else ("exited", _exited(exc))
    except Exception as exc:  # the app's ServerApp: whatever it raises before it sends
        answer = ("raised", one_line(exc))
    answers.send(answer)


def _portable(content: RecordDict) -> RecordDict:
    """Return what :func:`_from_message` reads of ``content`` (its first arrays and config), fit to pickle.

    Each array's data as bytes (Flower's may be a memoryview, which does not pickle); no 2 GiB protobuf limit.
    """
    out = RecordDict()
    arrays = next((r for r in content.values() if isinstance(r, ArrayRecord)), None)
    config = next((r for r in content.values() if isinstance(r, ConfigRecord)), None)
    if arrays is not None:
        out["arrays"] = ArrayRecord({name: Array(dtype=a.dtype, shape=tuple(a.shape), stype=a.stype,
                                                 data=bytes(a.data)) for name, a in arrays.items()})
    if config is not None:
        out["config"] = config
    return out


def _exited(exc: SystemExit) -> str:
    """Say how ``sys.exit(code)`` ends a process: ``exited with code 3 (SystemExit)``."""
    if isinstance(exc.code, int):
        return f"exited with code {int(exc.code)} (SystemExit)"
    return f"exited with code 1 ({one_line(exc)})"  # sys.exit("message") prints it and exits 1


def _ended(code: int | None) -> str:
    """How a process ended that sent no answer: its exit code, or the signal that killed it."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"ended its process with exit code {code}"


def _from_message(content: RecordDict, source: str) -> AppModel:
    arrays = next((r for r in content.values() if isinstance(r, ArrayRecord)), None)
    config = next((r for r in content.values() if isinstance(r, ConfigRecord)), None)
    if arrays is None:
        raise AppModelError(f"{source}: its first message carries no ArrayRecord")
    return model_from_arrays(arrays, source, config)


def first_reply_model(grid: Grid, deadline_s: float = _FIRST_REPLY_S) -> AppModel:
    """Ask one node to ``train`` with an empty ``ArrayRecord`` (round 0); its reply's arrays are the model.

    Raises
    ------
    AppModelError
        No node, no reply within ``deadline_s``, an error reply (its reason), or a reply without arrays.
    """
    nodes = sorted(grid.get_node_ids())
    if not nodes:
        raise AppModelError("no node is connected to ask for the model")
    content = RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({"server-round": 0})})
    replies: list[Message] = []
    collect(grid, push(grid, {nodes[0]: content}, "train", 0), deadline_s, lambda _, reply: replies.append(reply))
    what = f"node {nodes[0]}'s reply to a train message without arrays (round 0)"
    if not replies:
        raise AppModelError(f"{what} did not come within {deadline_s:g} s")
    if replies[0].has_error():
        raise AppModelError(f"{what} is an error: {one_line(RuntimeError(replies[0].error.reason))}")
    return _from_message(replies[0].content, what)


def arrays_of(model: AppModel, params: np.ndarray) -> dict[str, np.ndarray]:
    """``params`` (a flat buffer of ``model``'s layout) as the app's named arrays."""
    out, offset = {}, 0
    for name, shape, n in zip(model.layout.names, model.layout.shapes, model.layout.sizes, strict=True):
        out[name] = np.asarray(params[offset:offset + n]).reshape(shape)
        offset += n
    return out
