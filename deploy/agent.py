"""The edge client agent: a Flower SuperNode plus one warm ClientApp worker.

``quorum client start`` runs three processes on a device:

* the **agent** itself, a small supervisor that restarts the other two when
  they exit (the aggregator went away for longer than Flower's retries, a
  crash) with a capped back-off, and stops both on SIGTERM/SIGINT;
* the **SuperNode** (Flower's ``flower-supernode``, ``--isolation process``):
  it dials the aggregator over TLS, authenticates with the device's key and
  pulls messages. Flower hard-codes a 3 s sleep when a pull finds nothing;
  the agent runs the SuperNode with that sleep set to ``--poll-s``;
* the **worker**: where Flower's SuperExec would start a fresh
  ``flwr-clientapp`` process for every message (1.5-2.5 s of imports, the
  model and data loaded again), the worker is one long-lived process that
  takes tasks from the SuperNode's local Runtime API and runs Quorum's
  ClientApp in-process, so the model and the device's data are loaded once.
  It runs this installation's ClientApp, never code shipped by the
  aggregator (the app bundle Quorum submits carries configuration only).

The device's data file is opened by the worker only; nothing but model
updates and metrics leaves the device. The data owner's site policy
(``--policy``, ``clients.policy``) travels to the worker in the SuperNode's
node config, the device's own, with the file that counts its rounds in the
agent's folder; the worker reads it at start and again whenever it changes,
and refuses a round that breaks it before the data file is opened.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from typing import Any

from deploy.agent_console import AgentConsole, public_reason, reply_summary

__all__ = ["AgentSpec", "supernode_argv", "child_args", "run_agent", "serve_tasks", "run_supernode", "main"]

IDLE_SLEEP_S = 3.0       # Flower 1.42's SuperNode: sleep after a pull that found nothing
REPLY_SLEEP_S = 0.5      # ... and between checks for a ClientApp's reply
MAX_BACKOFF_S = 30.0
RECONNECT_MAX_S = 4.0    # the longest wait between two tries to reach a SuperLink that went away (Flower: 20)
TASK_RETRY_S = 10.0      # how long one task keeps retrying calls to its SuperNode
TASK_INPUT_S = 20.0      # default wait of one task for its message's content (Flower: 2 h)


@dataclass(frozen=True)
class AgentSpec:
    """What ``quorum client start`` was given."""

    server: str                    # HOST:PORT of the aggregator's device-facing port
    data: Path                     # the device's own data file (CSV or NPZ)
    key: Path | None               # the device's private key (OpenSSH, ECDSA P-384)
    ca: Path | None                # the federation's CA certificate
    name: str = ""                 # the name it was enrolled under (recorded in node config)
    runtime_port: int = 9094       # the SuperNode's local Runtime API (127.0.0.1)
    poll_s: float = 1.0            # how often an idle SuperNode asks for work
    task_input_s: float = TASK_INPUT_S  # how long a task waits for its message's content
    insecure: bool = False
    workdir: Path = Path(".quorum-agent")
    max_restarts: int | None = None  # None: forever
    reconnect_max_s: float = RECONNECT_MAX_S  # cap on the SuperNode's back-off while the aggregator is away
    # secure aggregation against a lying server (docs/secagg.md): this device's enrolled Ed25519
    # identity key (a file holding its hex) and the operator's enrolment directory (JSON)
    secagg_identity: Path | None = None
    secagg_directory: Path | None = None
    policy: Path | None = None  # the data owner's site policy (policy.toml, clients.policy)
    # an edge aggregator's upstream agent (``quorum aggregator start --edge``): no data of its own; the
    # aggregator's messages go to the edge's ServerApp through this hand-off folder (clients.edge)
    edge_channel: Path | None = None

    @property
    def rounds_file(self) -> Path:
        """Return where the device counts the rounds it trained (``max_rounds_per_day``): in its own folder."""
        return self.workdir / "policy-rounds.json"

    @property
    def runtime_address(self) -> str:
        """Return the SuperNode's ClientApp runtime address: ``127.0.0.1:<runtime_port>``."""
        return f"127.0.0.1:{self.runtime_port}"


def supernode_argv(spec: AgentSpec) -> list[str]:
    """``flower-supernode`` arguments for ``spec`` (retries forever; node config names the data)."""
    node_config = (f'edge-channel="{spec.edge_channel.resolve()}"' if spec.edge_channel is not None
                   else f'data-path="{spec.data.resolve()}"')
    if spec.name:
        node_config += f' client-name="{spec.name}"'
    if spec.secagg_identity is not None:
        node_config += f' secagg-identity-key-file="{spec.secagg_identity.resolve()}"'
    if spec.secagg_directory is not None:
        node_config += f' secagg-directory="{spec.secagg_directory.resolve()}"'
    if spec.policy is not None:
        node_config += f' site-policy="{spec.policy.resolve()}" site-policy-rounds="{spec.rounds_file.resolve()}"'
    argv = ["--superlink", spec.server, "--isolation", "process", "--host", "127.0.0.1",
            "--port", str(spec.runtime_port), "--node-config", node_config]
    if spec.insecure:
        return [*argv, "--insecure"]
    if spec.ca is None or spec.key is None:
        raise ValueError("TLS needs the federation's CA certificate (--ca) and the device key (--key)")
    return [*argv, "--root-certificates", str(spec.ca.resolve()),
            "--auth-supernode-private-key", str(spec.key.resolve())]


# --------------------------------------------------------------------- SuperNode


class _PollClock:
    """Stand in for the ``time`` module inside Flower's SuperNode loop only.

    Its idle sleeps become ``poll_s`` and its reply sleeps a tenth of it
    (between 0.01 s and Flower's own).
    """

    def __init__(self, poll_s: float) -> None:
        self._poll_s = poll_s

    def sleep(self, seconds: float) -> None:
        if seconds == IDLE_SLEEP_S:
            seconds = self._poll_s
        elif seconds == REPLY_SLEEP_S:
            seconds = min(REPLY_SLEEP_S, max(0.01, self._poll_s / 10))
        time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def _fresh_replies_first(push: Any) -> Any:
    """Wrap Flower's ``_push_messages`` so that a stale reply never stands in for the next one.

    Flower's SuperNode pulls one message, then pushes the replies that are ready,
    waiting for at least one. When the aggregator dies after a device downloaded a
    message but before the device confirmed it, Flower deletes that message as not
    received; the worker still trains on it and leaves a reply in the node's state.
    The next message pulled (the standby's replayed round) then pushes that stale
    reply (its run is unknown there: a 500) and returns, and its own reply waits
    for the message after: every reply one round late, the device dropped from
    every round (seen after the fifth failover of ``bench/failover.py``).

    A reply to a message this node no longer holds is dropped here, logged, and the
    wait goes on for a reply to a message it does hold. Flower 1.42's in-memory
    node state (``msg_store``, ``lock_msg_store``) is read; another state is left to
    Flower's own push.
    """
    from flwr.common.logger import log

    @functools.wraps(push)
    def push_messages(state: Any, object_store: Any, send: Any, push_object: Any) -> None:
        if not hasattr(state, "msg_store") or not hasattr(state, "lock_msg_store"):
            return push(state, object_store, send, push_object)  # type: ignore[no-any-return]
        while True:
            with state.lock_msg_store:
                held = [(e.message.metadata, e.is_retrieved) for e in state.msg_store.values()]
            pulled = {m.message_id for m, _ in held if not m.reply_to_message_id}
            ready = [m for m, taken in held if m.reply_to_message_id and not taken]
            stale = [m for m in ready if m.reply_to_message_id not in pulled]
            for m in stale:
                log(WARNING, "Dropping reply %s of run %s: the message it answers (%s) was not received whole",
                    m.message_id, m.run_id, m.reply_to_message_id)
                state.delete_messages(message_ids=[m.message_id])
                object_store.delete(m.message_id)
            if len(ready) > len(stale):
                return push(state, object_store, send, push_object)  # type: ignore[no-any-return]
            time.sleep(min(REPLY_SLEEP_S, 0.05))

    push_messages.drops_stale_replies = True  # type: ignore[attr-defined]
    return push_messages


def run_supernode(argv: Sequence[str], poll_s: float, reconnect_max_s: float = RECONNECT_MAX_S) -> None:
    """Run Flower's SuperNode in this process, its idle poll set to ``poll_s``.

    Flower retries a request that found no SuperLink after a random wait of up
    to 1, 2, 4, ... 20 s ("full jitter"): a device that failed for 6 s while an
    aggregator failed over could sleep 8 s more after the standby answered.
    ``reconnect_max_s`` caps that doubling (Flower's own retry, same jitter), so
    a device is back within that long of the aggregator's return; each device
    still spreads its tries at random, a mean of one every ``reconnect_max_s / 2``.
    """
    import flwr.supercore.retry.grpc_retry as grpc_retry
    import flwr.supercore.retry.http_retry as http_retry
    import flwr.supernode.start_client_internal as loop
    from flwr.supercore.logger import update_console_handler
    from flwr.supernode.cli.flower_supernode import flower_supernode

    update_console_handler(timestamps=True, colored=False)
    if poll_s < IDLE_SLEEP_S:
        # a stand-in for the time module (duck-typed), which that module imports without re-exporting
        loop.time = _PollClock(poll_s)  # type: ignore[assignment,attr-defined]
    for retry in (http_retry, grpc_retry):  # read by each retry invoker's wait generator, at each request
        retry.MAX_RETRY_DELAY = reconnect_max_s  # type: ignore[attr-defined]
    if not getattr(loop._push_messages, "drops_stale_replies", False):
        loop._push_messages = _fresh_replies_first(loop._push_messages)
    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


# ------------------------------------------------------------------------ worker


def _runtime_client(address: str, token: str | None, retry: bool = True) -> Any:
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    interceptors: list[Any] = [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp")]
    if token is not None:
        interceptors.append(RuntimeTokenHttpInterceptor(token))
    invoker = None
    if retry:  # bounded: a task whose SuperNode is gone for this long is lost anyway
        invoker = make_simple_http_retry_invoker()
        invoker.max_time = TASK_RETRY_S
    return RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                 interceptors=interceptors, retry_invoker=invoker)


def _heartbeat(client: Any) -> Any:
    """Task heartbeats that report failure instead of signalling the process (Flower's default)."""
    import httpx
    from flwr.proto.runtime_pb2 import SendTaskHeartbeatRequest
    from flwr.supercore.heartbeat import HeartbeatSender

    def beat() -> bool:
        try:
            return bool(client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success)
        except (httpx.HTTPError, OSError):
            return False

    return HeartbeatSender(beat)


def _pull_task_input(client: Any, max_time: float = TASK_INPUT_S) -> tuple[Any, Any]:
    """Flower's ``pull_task_input``, with the wait for the message's content bounded.

    The SuperNode creates the task before it downloads the message from the
    SuperLink. If the SuperLink dies mid-download and the run is over when it
    comes back, the SuperNode drops the message without finishing the task:
    its content never arrives. Flower's own ``flwr-clientapp`` waits for it up
    to 2 hours in a process of its own; the one warm worker would wait as long
    and serve no other task (the resumed run's) meanwhile.
    """
    from flwr.app import Message
    from flwr.common.serde import context_from_proto
    from flwr.proto.node_pb2 import Node
    from flwr.proto.runtime_pb2 import (
        PullAppMessagesRequest,
        PullTaskInputRequest,
    )
    from flwr.supercore.inflatable.inflatable_protobuf_utils import (
        make_confirm_message_received_fn_protobuf,
        make_pull_object_fn_protobuf,
    )
    from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree
    from flwr.supercore.task_identity import TaskIdentity

    res = client.PullTaskInput(PullTaskInputRequest())
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = res.task_id, res.run.run_id, res.context.node_id
    context = context_from_proto(res.context)
    pulled = client.PullMessages(PullAppMessagesRequest())
    if not pulled.messages_list:
        raise RuntimeError("No messages received from Runtime API")
    tree = pulled.message_object_trees[0]
    node = Node(node_id=context.node_id)
    message = pull_and_inflate_object_from_tree(
        tree, make_pull_object_fn_protobuf(client.PullObject, node, context.run_id),
        make_confirm_message_received_fn_protobuf(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message, max_time=max_time, backoff_cap=1.0)  # local polls: cheap; the limit holds
    message.metadata.__dict__["_message_id"] = tree.object_id  # the deflated message lacks its own id
    return message, context


def run_task(address: str, token: str, client_app: Any, task_input_s: float = TASK_INPUT_S) -> str:
    """One ClientApp task, in this process: what ``flwr-clientapp`` does, minus the process.

    Returns what the device's console shows of it: the final status
    (``completed`` or ``failed``), then the reason of a failure or the
    reply's metrics. A message whose content has not arrived within
    ``task_input_s`` fails the task.
    """
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supernode.runtime.run_clientapp import push_message, push_task_output

    client = _runtime_client(address, token)
    beats = _heartbeat(client)
    beats.start()
    message = context = reply = None
    status, details, local = SubStatus.FAILED, "ClientApp task failed", ""
    try:
        message, context = _pull_task_input(client, task_input_s)
        reply = client_app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as exc:
        details, local = public_reason(exc), f"{type(exc).__name__}: {exc}"  # the aggregator gets no paths
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        finally:
            beats.stop()
            push_task_output(client=client, context=context, sub_status=status, details=details)
            client.close()
    return f"{status}: {local or details}" if details else f"{status}{reply_summary(reply)}"


def serve_tasks(address: str, poll_s: float, stop: threading.Event | None = None,
                task_input_s: float = TASK_INPUT_S) -> None:
    """Take ClientApp tasks from the SuperNode at ``address`` until ``stop`` is set."""
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType

    from clients.clientapp import app as client_app

    stop = stop or threading.Event()
    # No retries with back-off here: while the SuperNode restarts, asking again every
    # poll is what keeps the first task after a reconnect from waiting half a minute.
    acquirer = _runtime_client(address, None, retry=False)
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    while not stop.is_set():
        try:
            res = acquirer.AcquireTask(request)
        except (httpx.HTTPError, OSError):  # the SuperNode is (re)starting
            stop.wait(max(poll_s, 0.5))
            continue
        if res.HasField("task") and res.token:
            started = time.monotonic()
            try:
                status = run_task(address, res.token, client_app, task_input_s)
            except Exception as exc:
                status = f"lost ({type(exc).__name__}: {exc})"
            print(f"{time.strftime('%H:%M:%S')} quorum-worker: task {res.task.task_id} {status} "
                  f"in {time.monotonic() - started:.2f} s", flush=True)
            continue  # a round sends train then evaluate: ask again at once
        stop.wait(poll_s)


# ------------------------------------------------------------------- supervisor


def _child(role: str, args: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "deploy.agent", role, *args], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("FLWR_HOME", str(Path(env.get("QUORUM_AGENT_HOME", ".quorum-agent")).resolve() / "flwr-home"))
    return env


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def child_args(spec: AgentSpec) -> dict[str, list[str]]:
    """Return the arguments of the agent's two children (``python -m deploy.agent ROLE ...``), by role."""
    return {
        "supernode": ["--poll-s", str(spec.poll_s), "--reconnect-max-s", str(spec.reconnect_max_s), "--",
                      *supernode_argv(spec)],
        "worker": ["--runtime", spec.runtime_address, "--poll-s", str(min(spec.poll_s, 0.2)),
                   "--task-input-s", str(spec.task_input_s),
                   *(["--policy", str(spec.policy.resolve())] if spec.policy is not None else [])],
    }


def run_agent(spec: AgentSpec, say: Any = print) -> int:
    """Supervise the SuperNode and the worker until SIGTERM/SIGINT; returns an exit code.

    3: a setup mistake that restarting cannot fix (a busy port, a CA that does not verify, a key the
    aggregator refuses), said in one line naming the fix.
    """
    logs = spec.workdir / "logs"
    env = _child_env()
    env["FLWR_HOME"] = str((spec.workdir / "flwr-home").resolve())
    roles = child_args(spec)
    console = AgentConsole(logs, spec.name, say, server=spec.server)
    procs = {role: _child(role, args, logs / f"{role}.log", env) for role, args in roles.items()}
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    restarts, backoff = 0, 1.0
    try:
        while not stopping.wait(0.5):
            console.poll()
            for role, proc in procs.items():
                if proc.poll() is None:
                    continue
                restarts += 1
                verdict = console.after_exit(role, proc.returncode, restarts, spec.max_restarts, backoff)
                if verdict is not None:
                    return verdict
                if stopping.wait(backoff):
                    break
                backoff = min(MAX_BACKOFF_S, backoff * 2)
                procs[role] = _child(role, roles[role], logs / f"{role}.log", env)
            else:
                if restarts and all(p.poll() is None for p in procs.values()):
                    backoff = max(1.0, backoff * 0.9)  # heal slowly while things stay up
    finally:
        _stop(list(procs.values()))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m deploy.agent supernode|worker ...``: the agent's child processes."""
    parser = argparse.ArgumentParser(prog="python -m deploy.agent")
    sub = parser.add_subparsers(dest="role", required=True)
    node = sub.add_parser("supernode")
    node.add_argument("--poll-s", type=float, default=1.0)
    node.add_argument("--reconnect-max-s", type=float, default=RECONNECT_MAX_S)
    node.add_argument("rest", nargs=argparse.REMAINDER)
    worker = sub.add_parser("worker")
    worker.add_argument("--runtime", required=True)
    worker.add_argument("--poll-s", type=float, default=0.2)
    worker.add_argument("--task-input-s", type=float, default=TASK_INPUT_S)
    worker.add_argument("--policy", default=None)
    args = parser.parse_args(argv)
    if args.role == "supernode":
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        run_supernode(rest, args.poll_s, args.reconnect_max_s)
        return
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if stop.is_set():  # asked twice: leave now, even mid-task
            raise SystemExit(0)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if args.policy is not None:
        _announce_policy(Path(args.policy))
    serve_tasks(args.runtime, args.poll_s, stop, args.task_input_s)


def _announce_policy(path: Path) -> None:
    """Read the site policy once at start and say which rules hold (the ClientApp reads it again when it changes)."""
    from clients.policy.errors import PolicyError
    from clients.policy.mod import current_policy

    try:
        said = f"site policy {path}: {current_policy(path).describe()}"
    except PolicyError as exc:
        said = f"site policy refused, every task will be refused until it is mended: {exc}"
    print(f"{time.strftime('%H:%M:%S')} quorum-worker: {said}", flush=True)


if __name__ == "__main__":
    main()
