"""Quorum on Flower's simulation runtime (Ray): ``quorum simulate --engine ray``.

The very same round loop (:func:`aggregator.serverapp.run_federation`) and
ClientApp (:data:`clients.clientapp.app`) run on Flower's Virtual Client
Engine, with one Ray actor per CPU executing client messages.

Three seams make Flower's ``run_simulation`` fit:

- It hands the ServerApp and every ClientApp an *empty* run config. The
  ServerApp here is a closure over the scenario and the store, and the
  ClientApp is wrapped (:class:`ScenarioClient`) so every node's ``Context``
  carries the scenario as ``scenario-json``, exactly as in-process.
- Its virtual nodes get random 64-bit ids. The round loop samples clients and
  seeds their training by node id, so :class:`PartitionGrid` asks every node
  its ``partition-id`` once and presents node ``partition-id + 1``: the ids the
  in-process runtime uses, so a seed samples and trains the same clients.
- Faults from the scenario are injected by :class:`PartitionGrid`, at the
  transport, by the same :class:`~aggregator.faults.FaultPlan`.

Ray is started as a private local cluster (``address="local"``, dashboard off,
its own temporary directory) sized to ``num_cpus``, and is shut down at the
end; any of its processes still alive after a grace period are killed by PID.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from aggregator.faults import FaultPlan
from aggregator.store import RoundRecord, RunStore
from scenarios.schema import Scenario

__all__ = ["run_on_ray", "RayOptions", "ScenarioClient", "PartitionGrid", "ray_processes", "NODE_INFO",
           "MARKER_ENV"]

NODE_INFO = "query.quorum_node_info"
MARKER_ENV = "QUORUM_RAY_CLUSTER"
"""Environment variable naming the Ray cluster a process belongs to (see :func:`ray_processes`)."""
"""Message type a :class:`ScenarioClient` answers itself with its node config."""

_QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "FLWR_TELEMETRY_ENABLED": "0",
              "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
              "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


@dataclass(frozen=True)
class RayOptions:
    """How big a Ray cluster to start.

    Parameters
    ----------
    num_cpus : int | None
        CPUs Ray may use; ``None`` means ``min(2, os.cpu_count())``.
    cpus_per_client : float
        CPUs reserved per ClientApp actor; actors = ``num_cpus / cpus_per_client``.
    object_store_mb : int | None
        Ray object store size; ``None`` lets Ray choose (30 % of RAM, lazily).
    discovery_timeout_s : float
        How long the first contact with every node (actor start-up) may take.
    """

    num_cpus: int | None = None
    cpus_per_client: float = 1.0
    object_store_mb: int | None = None
    discovery_timeout_s: float = 300.0

    def cpus(self) -> int:
        return self.num_cpus if self.num_cpus is not None else max(1, min(2, os.cpu_count() or 1))


def run_on_ray(scenario: Scenario, db_url: str, resume_id: str | None = None,
               on_start: Callable[[str], None] | None = None,
               on_round: Callable[[RoundRecord], None] | None = None,
               options: RayOptions = RayOptions()) -> str:
    """Run (or resume) ``scenario`` on Flower's Ray simulation; returns the run id.

    Every round is committed to the store at ``db_url`` by the round loop, as
    in-process. Ray is always shut down before this returns or raises.
    """
    from flwr.simulation import run_simulation

    from clients.clientapp import app as client_app

    outcome: dict[str, str] = {}
    server_app = _server_app(scenario, db_url, resume_id, on_start, on_round, outcome,
                             options.discovery_timeout_s)
    client = ScenarioClient(client_app, {"scenario-json": json.dumps(scenario.to_dict())})
    temp_dir = tempfile.mkdtemp(prefix="quorum-ray-")
    try:
        with _quiet_environment(temp_dir), _quiet_flower_log():
            run_simulation(server_app=server_app, client_app=client,  # type: ignore[arg-type]
                           num_supernodes=scenario.federation.clients,
                           backend_config=_backend_config(options, temp_dir))
    finally:
        _shutdown_ray(temp_dir)
    if "run_id" not in outcome:  # the ServerApp died before opening the run
        raise RuntimeError(f"Ray simulation ended without a run: {outcome.get('error', 'unknown error')}")
    return outcome["run_id"]


def _server_app(scenario: Scenario, db_url: str, resume_id: str | None,
                on_start: Callable[[str], None] | None, on_round: Callable[[RoundRecord], None] | None,
                outcome: dict[str, str], discovery_timeout_s: float) -> ServerApp:
    """A ServerApp bound to this scenario and store (``run_simulation`` passes no run config)."""
    from aggregator.serverapp import run_federation

    app = ServerApp()

    def started(run_id: str) -> None:
        outcome["run_id"] = run_id
        if on_start is not None:
            on_start(run_id)

    @app.main()
    def main(grid: Grid, context: Context) -> None:  # noqa: ARG001 - the run config is empty here
        try:
            remapped = PartitionGrid.discover(grid, FaultPlan.from_spec(scenario.faults, scenario.seed),
                                              expected=scenario.federation.clients,
                                              timeout_s=discovery_timeout_s)
            run_federation(remapped, scenario, RunStore(db_url), engine="ray", resume_id=resume_id,
                           on_round=on_round, on_start=started)
        except BaseException as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"
            raise

    return app


def _backend_config(options: RayOptions, temp_dir: str) -> dict[str, Any]:
    init_args: dict[str, Any] = {"address": "local", "num_cpus": options.cpus(), "num_gpus": 0,
                                 "include_dashboard": False, "_temp_dir": temp_dir,
                                 "logging_level": "ERROR", "log_to_driver": True}
    if options.object_store_mb is not None:
        init_args["object_store_memory"] = options.object_store_mb * 2**20
    return {"init_args": init_args,
            "client_resources": {"num_cpus": options.cpus_per_client, "num_gpus": 0.0}}


class ScenarioClient:
    """Quorum's ClientApp, with the run config ``run_simulation`` leaves out.

    Called by a Ray actor as ``client(message=..., context=...)`` like a
    ``ClientApp``. It also answers :data:`NODE_INFO` itself, so the aggregator
    can learn which partition each virtual node holds.
    """

    def __init__(self, app: ClientApp, run_config: dict[str, str]) -> None:
        self._app = app
        self._run_config = dict(run_config)

    def __call__(self, message: Message, context: Context) -> Message:
        if message.metadata.message_type == NODE_INFO:
            info = ConfigRecord({k: v for k, v in context.node_config.items()
                                 if isinstance(v, (int, float, str, bool))})
            return Message(RecordDict({"node": info}), reply_to=message)
        # Flower refuses a context whose run config changed, so lend it for the call only.
        original = context.run_config
        context.run_config = {**original, **self._run_config}
        try:
            return self._app(message, context)
        finally:
            context.run_config = original


class PartitionGrid(Grid):
    """A Grid over Flower's that names node ``partition-id + 1`` and injects faults.

    Parameters
    ----------
    inner : Grid
        Flower's grid (random node ids).
    node_map : dict[int, int]
        Logical id (``partition-id + 1``) -> Flower node id.
    faults : FaultPlan
        The scenario's faults, decided on logical ids as in-process.
    """

    def __init__(self, inner: Grid, node_map: dict[int, int], faults: FaultPlan) -> None:
        self._inner = inner
        self._to_real = dict(node_map)
        self._to_logical = {real: logical for logical, real in node_map.items()}
        self._faults = faults
        self._sent: dict[str, Message] = {}       # message id -> instruction (logical ids)
        self._dropped: set[str] = set()           # ids that will never be answered
        self._held: dict[str, tuple[float, Message]] = {}  # straggler replies: ready time, reply

    @classmethod
    def discover(cls, inner: Grid, faults: FaultPlan, *, expected: int, timeout_s: float) -> "PartitionGrid":
        """Ask every node its partition; fails if a node does not answer in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        nodes: list[int] = []
        while len(nodes) < expected and time.monotonic() < deadline:
            nodes = list(inner.get_node_ids())
            time.sleep(0.05 if len(nodes) < expected else 0)
        messages = [Message(RecordDict(), n, NODE_INFO, group_id="0") for n in nodes]
        replies = inner.send_and_receive(messages, timeout=max(1.0, deadline - time.monotonic()))
        node_map = {}
        for reply in replies:
            if reply.has_error():
                raise RuntimeError(f"node {reply.metadata.src_node_id} failed to start: {reply.error.reason}")
            partition = int(reply.content.config_records["node"]["partition-id"])
            node_map[partition + 1] = reply.metadata.src_node_id
        if len(node_map) != expected:
            raise TimeoutError(f"{len(node_map)} of {expected} simulated nodes answered within {timeout_s:g} s")
        return cls(inner, node_map, faults)

    # -- Grid API ---------------------------------------------------------
    def set_run(self, run: Any) -> None:
        self._inner.set_run(run)

    @property
    def run(self) -> Any:
        return self._inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self._to_real)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        batch = list(messages)
        dropped = self._faults.pick_dropped(batch)  # decided on logical ids, as in-process
        ids = []
        for message in batch:
            logical = message.metadata.dst_node_id
            if logical not in self._to_real:
                raise ValueError(f"unknown node id {logical}")
            if id(message) in dropped:
                ids.append(f"dropped-{len(self._dropped)}-{logical}-{time.monotonic_ns()}")
                self._dropped.add(ids[-1])
                continue
            # Flower's in-memory state keeps this very object: leave the real id on it, and
            # keep a logical stand-in (sharing the content) for the fault decisions.
            stand_in = Message(message.content, logical, message.metadata.message_type,
                               group_id=message.metadata.group_id)
            message.metadata.dst_node_id = self._to_real[logical]
            (message_id,) = self._inner.push_messages([message])
            self._sent[message_id] = stand_in
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = [m for m in message_ids if m not in self._dropped]
        for reply in self._inner.pull_messages([m for m in wanted if m not in self._held]):
            self._arrived(reply)
        now = time.monotonic()
        ready = [m for m in wanted if m in self._held and self._held[m][0] <= now]
        return [self._held.pop(m)[1] for m in ready]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        ids = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while ids - self._dropped and (deadline is None or time.monotonic() < deadline):
            for reply in self.pull_messages(list(ids)):
                ids.discard(reply.metadata.reply_to_message_id)
                replies.append(reply)
            time.sleep(0.01)
        return replies

    def settled(self, message_ids: Iterable[str]) -> bool:
        """True when every id left is a dropped message (no reply can come)."""
        return all(m in self._dropped for m in message_ids)

    def _arrived(self, reply: Message) -> None:
        instruction = self._sent.pop(reply.metadata.reply_to_message_id, None)
        real = reply.metadata.src_node_id
        reply.metadata.__dict__["_src_node_id"] = self._to_logical.get(real, real)
        if instruction is None:
            return
        reply = self._faults.corrupt(instruction, reply)
        delay = self._faults.delay_for(instruction)
        self._held[reply.metadata.reply_to_message_id] = (time.monotonic() + delay, reply)


# -- process hygiene ------------------------------------------------------------
@contextlib.contextmanager
def _quiet_environment(marker: str) -> Iterator[None]:
    """Telemetry off, and a marker every Ray process inherits; restore the environment after.

    ``RayBackend.init_ray`` overwrites ``PYTHONPATH`` with this interpreter's
    ``sys.path`` so that actors import the app; that must not leak out either.
    """
    saved = {k: os.environ.get(k) for k in (*_QUIET_ENV, "PYTHONPATH", MARKER_ENV)}
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    os.environ[MARKER_ENV] = marker
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_flower_log() -> Iterator[None]:
    """Flower logs its deprecation notice for ``run_simulation`` at WARNING; keep errors."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def ray_processes(marker: str | Path) -> list[int]:
    """PIDs of live processes of the Ray cluster that ``run_on_ray`` tagged with ``marker``.

    Ray's GCS, raylet, agents and workers all inherit :data:`MARKER_ENV` from
    the driver (their command lines do not always say which cluster they
    belong to: workers rename themselves ``ray::ClientAppActor``). Linux only.
    """
    needle = f"{MARKER_ENV}={marker}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ and state != "Z":
            pids.append(int(entry.name))
    return pids


def _shutdown_ray(temp_dir: str, grace_s: float = 15.0) -> None:
    """Shut Ray down, SIGKILL whatever of its cluster outlives ``grace_s``, remove its files.

    Workers notice their raylet is gone and exit by themselves, a few seconds
    later; until then they still hold memory and CPU, so wait for them.
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    deadline = time.monotonic() + grace_s
    while ray_processes(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in ray_processes(temp_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)
