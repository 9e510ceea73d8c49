"""Quorum on Flower's simulation runtime (Ray): ``quorum simulate --engine ray``.

The very same round loop (:func:`aggregator.serverapp.run_federation`) and
ClientApp (:data:`clients.clientapp.app`) run on Flower's Virtual Client
Engine, one Ray actor per CPU executing client messages. Three seams:

- ``run_simulation`` hands every app an *empty* run config: the ServerApp is
  bound to the scenario and store here, and :class:`ScenarioClient` lends each
  ClientApp call the scenario as ``scenario-json``, as in-process.
- Its virtual nodes get random ids, while clients are sampled and seeded by
  node id: :class:`PartitionGrid` and :class:`ScenarioClient` make both sides
  see node ``partition-id + 1``, the in-process ids, so a seed gives the same
  clients, seeds and secure-aggregation identities on either runtime.
- Faults from the scenario are injected by :class:`PartitionGrid` with the
  same :class:`~aggregator.faults.FaultPlan`, at the transport.

Ray runs as a private local cluster (``address="local"``, no dashboard, its
own temporary directory) of ``num_cpus`` CPUs, and is shut down at the end;
its processes still alive after a grace period are killed by PID.
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
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
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
"""Message type a :class:`ScenarioClient` answers itself with its partition id."""
MARKER_ENV = "QUORUM_RAY_CLUSTER"
"""Environment variable naming the Ray cluster a process belongs to (see :func:`ray_processes`)."""

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
    verbose : bool
        Forward the actors' output and Ray's warnings (a failing client is stored either way).
    """

    num_cpus: int | None = None
    cpus_per_client: float = 1.0
    object_store_mb: int | None = None
    discovery_timeout_s: float = 300.0
    verbose: bool = False

    def cpus(self) -> int:
        return self.num_cpus or max(1, min(2, os.cpu_count() or 1))


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

    run = _RayRun(scenario, RunStore(db_url), resume_id, on_start, on_round,  # a bad URL fails here
                  options.discovery_timeout_s, _Cluster(tempfile.mkdtemp(prefix="quorum-ray-")))
    client = ScenarioClient(client_app, {"scenario-json": json.dumps(scenario.to_dict())})
    try:
        with _quiet_run(run.cluster.temp_dir, options.verbose):
            run_simulation(server_app=run.server_app(), client_app=client,  # type: ignore[arg-type]
                           num_supernodes=scenario.federation.clients,
                           backend_config=_backend_config(options, run.cluster.temp_dir))
    finally:
        _shutdown_ray(run.cluster)
    if run.run_id is None:  # the ServerApp died before opening the run
        raise RuntimeError(f"Ray simulation ended without a run: {run.error or 'unknown error'}")
    return run.run_id


@dataclass
class _RayRun:
    """One ``run_on_ray`` call: what its ServerApp is bound to (Flower passes no run config)."""

    scenario: Scenario
    store: RunStore
    resume_id: str | None
    on_start: Callable[[str], None] | None
    on_round: Callable[[RoundRecord], None] | None
    discovery_timeout_s: float
    cluster: _Cluster
    run_id: str | None = None
    error: str | None = None

    def server_app(self) -> ServerApp:
        app = ServerApp()
        app.main()(self._main)
        return app

    def _main(self, grid: Grid, context: Context) -> None:  # noqa: ARG002 - the run config is empty
        from aggregator.serverapp import run_federation

        sc = self.scenario
        try:
            remapped = PartitionGrid.discover(grid, FaultPlan.from_spec(sc.faults, sc.seed),
                                              expected=sc.federation.clients, timeout_s=self.discovery_timeout_s)
            self.cluster.snapshot()
            run_federation(remapped, sc, self.store, engine="ray", resume_id=self.resume_id,
                           on_round=self.on_round, on_start=self._started)
        except BaseException as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.cluster.snapshot()  # the actors are still up: Flower stops them after main returns

    def _started(self, run_id: str) -> None:
        self.run_id = run_id
        if self.on_start is not None:
            self.on_start(run_id)


def _backend_config(options: RayOptions, temp_dir: str) -> dict[str, Any]:
    init_args: dict[str, Any] = {"address": "local", "num_cpus": options.cpus(), "num_gpus": 0,
                                 "include_dashboard": False, "_temp_dir": temp_dir,
                                 "logging_level": "WARNING" if options.verbose else "ERROR",
                                 "log_to_driver": options.verbose}
    if options.object_store_mb is not None:
        init_args["object_store_memory"] = options.object_store_mb * 2**20
    return {"init_args": init_args,
            "client_resources": {"num_cpus": options.cpus_per_client, "num_gpus": 0.0}}


class ScenarioClient:
    """Quorum's ClientApp as the in-process runtime runs it, on a Flower virtual node.

    For the length of one call the app sees the run config that
    ``run_simulation`` leaves out, and the node id ``partition-id + 1`` (on
    its ``Context`` and as the message's destination), the id the aggregator
    knows it by through :class:`PartitionGrid`: training seeds and secure
    aggregation's node identities then agree with the aggregator and with the
    in-process runtime. The reply leaves with Flower's own id again. It also
    answers :data:`NODE_INFO` itself, so the aggregator can learn the mapping.
    """

    def __init__(self, app: ClientApp, run_config: dict[str, str]) -> None:
        self._app = app
        self._run_config = dict(run_config)

    def __call__(self, message: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        if message.metadata.message_type == NODE_INFO:
            return Message(RecordDict({"node": ConfigRecord({"partition-id": partition})}), reply_to=message)
        # Flower rejects a context whose run config changed: lend, call, restore.
        real, run_config = context.node_id, context.run_config
        context.node_id, context.run_config = partition + 1, {**run_config, **self._run_config}
        message.metadata.dst_node_id = partition + 1
        try:
            reply = self._app(message, context)
        finally:
            context.node_id, context.run_config = real, run_config
            message.metadata.dst_node_id = real
        reply.metadata.__dict__["_src_node_id"] = real  # Flower checks it against the instruction
        return reply


class PartitionGrid(Grid):
    """Flower's grid (``inner``, random node ids) seen with node ids ``partition-id + 1``.

    ``node_map`` maps those logical ids to Flower's. ``faults`` are decided on
    logical ids, so the same nodes vanish, straggle or lie as in-process.
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
        nodes = list(inner.get_node_ids())
        while len(nodes) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
            nodes = list(inner.get_node_ids())
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
                ids.append(f"dropped-{uuid.uuid4().hex}")
                self._dropped.add(ids[-1])
                continue
            # Flower's in-memory state keeps this very object: leave the real id on it, and
            # keep a logical stand-in (its configs, not its arrays) for the fault decisions.
            stand_in = Message(RecordDict(dict(message.content.config_records)), logical,
                               message.metadata.message_type, group_id=message.metadata.group_id)
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
def _quiet_run(marker: str, verbose: bool) -> Iterator[None]:
    """Telemetry off, a marker every Ray process inherits, Flower's log at ERROR; then restore.

    ``RayBackend.init_ray`` overwrites ``PYTHONPATH`` with this interpreter's
    ``sys.path`` (so that actors import the app): that must not leak out either.
    ``run_simulation`` logs a deprecation notice at WARNING.
    """
    saved = {k: os.environ.get(k) for k in (*_QUIET_ENV, "PYTHONPATH", MARKER_ENV)}
    for key, value in _QUIET_ENV.items():
        os.environ.setdefault(key, value)
    os.environ[MARKER_ENV] = marker
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.INFO if verbose else logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ray_processes(marker: str | Path) -> list[int]:
    """PIDs of live processes of the Ray cluster that ``run_on_ray`` tagged with ``marker``.

    Ray's GCS, raylet, agents and workers all inherit :data:`MARKER_ENV` from
    the driver (command lines do not tell: workers rename themselves
    ``ray::ClientAppActor``). Linux only (``/proc``).
    """
    needle = f"{MARKER_ENV}={marker}".encode() + b"\0"
    pids = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes() and _start_time(int(entry.name)):
                    pids.append(int(entry.name))
    return pids


def _start_time(pid: int) -> str | None:
    """Start time of a live, non-zombie process (field 22 of ``/proc/<pid>/stat``), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


@dataclass
class _Cluster:
    """One call's Ray processes: by marker, and by PID (with start time) once seen.

    An exiting process has an empty ``/proc/<pid>/environ``, so the marker
    alone can miss an actor on its way out.
    """

    temp_dir: str
    known: dict[int, str] = field(default_factory=dict)

    def snapshot(self) -> None:
        for pid in ray_processes(self.temp_dir):
            self.known[pid] = _start_time(pid) or ""

    def alive(self) -> list[int]:
        seen = {pid for pid, start in self.known.items() if start and _start_time(pid) == start}
        return sorted(seen | set(ray_processes(self.temp_dir)))


def _shutdown_ray(cluster: _Cluster, grace_s: float = 1.0, term_s: float = 10.0) -> None:
    """Shut Ray down, end what is left of its cluster by PID, remove its files.

    After ``ray.shutdown()`` actors notice their raylet is gone only seconds
    later (more under load), still holding memory and CPU: after ``grace_s``
    they get SIGTERM, and SIGKILL if still alive ``term_s`` later.
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, term_s), (None, 5.0)):
        deadline = time.monotonic() + wait_s
        while cluster.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in cluster.alive() if sig is not None else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    shutil.rmtree(cluster.temp_dir, ignore_errors=True)
