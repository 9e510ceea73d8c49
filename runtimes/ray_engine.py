"""Quorum on Flower's simulation runtime (Ray): ``quorum simulate --engine ray``.

The same round loop (:func:`aggregator.serverapp.run_federation`) and ClientApp
(:data:`clients.clientapp.app`) run on Flower's Virtual Client Engine, one Ray
actor per CPU. ``run_simulation`` gives both apps an empty run config and its
nodes random ids, so the ServerApp is bound to the scenario here, and
:class:`ScenarioClient` and :class:`PartitionGrid` make both sides see the run
config and node ``partition-id + 1``, as in-process: a seed gives the same
clients, training seeds, secure-aggregation identities and injected faults.
Ray runs as a private local cluster and is always shut down; what outlives
``ray.shutdown()`` is killed by PID. See docs/runtimes.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from aggregator.collect import Outstanding, collect
from aggregator.serverapp import run_federation
from clients.clientapp import app as client_app
from core.records import RoundRecord
from core.status import RunStatus
from runstore.store import RunStore
from runtimes.enrolment import secagg_identities
from runtimes.faults import FaultPlan
from runtimes.ray_cluster import MARKER_ENV, Cluster, ray_processes, shutdown_ray
from scenarios.schema import Scenario

__all__ = ["run_on_ray", "RayOptions", "ScenarioClient", "PartitionGrid", "ray_processes", "NODE_INFO"]

NODE_INFO = "query.quorum_node_info"  # answered by ScenarioClient itself: the node's partition id

# Telemetry off, no uv-run runtime env; the last one spares a FutureWarning from ray.init (num_gpus=0).
_QUIET_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "FLWR_TELEMETRY_ENABLED": "0",
              "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


@dataclass(frozen=True)
class RayOptions:
    """How big a Ray cluster to start.

    ``num_cpus``: CPUs Ray may use (default ``min(2, cpu_count)``);
    ``cpus_per_client``: CPUs per ClientApp actor (actors = ``num_cpus / cpus_per_client``);
    ``object_store_mb``: Ray's object store (default: Ray's choice);
    ``discovery_timeout_s``: how long actor start-up and first contact may take;
    ``verbose``: forward actor output and Ray's warnings (failing clients are stored anyway);
    ``address``: join the running Ray cluster there (``"auto"``, or the head's ``host:port``)
    instead of starting a private one: its nodes' CPUs size the actor pool, ``num_cpus`` and
    ``object_store_mb`` are the cluster's own, and the cluster is left running.
    """

    num_cpus: int | None = None
    cpus_per_client: float = 1.0
    object_store_mb: int | None = None
    discovery_timeout_s: float = 300.0
    verbose: bool = False
    address: str | None = None

    def cpus(self) -> int:
        """Return the CPUs Ray may use: ``num_cpus``, else ``min(2, cpu_count)``."""
        return self.num_cpus or max(1, min(2, os.cpu_count() or 1))


def run_on_ray(scenario: Scenario, db_url: str, resume_id: str | None = None,
               on_start: Callable[[str], None] | None = None,
               on_round: Callable[[RoundRecord], None] | None = None,
               options: RayOptions = RayOptions()) -> str:
    """Run (or resume) ``scenario`` on Flower's Ray simulation; returns the run id.

    Rounds are committed to the store at ``db_url`` as in-process. The first
    Ctrl-C ends the run after the client calls in flight (stored as
    ``interrupted``) and raises ``KeyboardInterrupt`` here; a second is Python's.
    """
    from flwr.simulation import run_simulation


    run = _RayRun(scenario, RunStore(db_url), resume_id, on_start, on_round,  # a bad URL fails here
                  options.discovery_timeout_s, Cluster(tempfile.mkdtemp(prefix="quorum-ray-")))
    client = ScenarioClient(client_app, {"scenario-json": json.dumps(scenario.to_dict())},
                            secagg_identities(scenario))
    try:
        with _quiet_run(run.cluster.temp_dir, options.verbose), _first_interrupt_stops(run):
            run_simulation(server_app=run.server_app(), client_app=client,  # type: ignore[arg-type]  # duck-typed ClientApp
                           num_supernodes=scenario.federation.clients,
                           backend_config=_backend_config(options, run.cluster.temp_dir))
    except KeyboardInterrupt:
        run.stopped = RunStatus.INTERRUPTED
        raise
    finally:
        run.stopped = run.stopped or "stopped"  # a ServerApp thread still running must end now
        shutdown_ray(run.cluster)
    if run.stopped == RunStatus.INTERRUPTED:
        raise KeyboardInterrupt(f"Ray simulation interrupted (run {run.run_id})")
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
    cluster: Cluster
    run_id: str | None = None
    error: str | None = None
    stopped: str | None = None  # set once Ray is gone: RunStatus.INTERRUPTED (Ctrl-C) or "stopped"

    def server_app(self) -> ServerApp:
        app = ServerApp()
        app.main()(self._main)
        return app

    def _main(self, grid: Grid, context: Context) -> None:  # noqa: ARG002 (Flower's main signature)
        sc, faults = self.scenario, FaultPlan.from_spec(self.scenario.faults, self.scenario.seed)
        try:
            remapped = PartitionGrid.discover(grid, faults, self._alive, expected=sc.federation.clients,
                                              timeout_s=self.discovery_timeout_s)
            self.cluster.snapshot()
            run_federation(remapped, sc, self.store, engine="ray", resume_id=self.resume_id,
                           on_round=self.on_round, on_start=self._started)
        except BaseException as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            if not (isinstance(exc, KeyboardInterrupt) and self.stopped == RunStatus.INTERRUPTED):
                raise  # else recorded as interrupted; run_on_ray raises it in the main thread
        finally:
            self.cluster.snapshot()  # the actors are still up: Flower stops them after main returns

    def _alive(self) -> None:
        """Raise in the ServerApp thread once Ray is gone, instead of waiting out deadlines."""
        if self.stopped == RunStatus.INTERRUPTED:
            raise KeyboardInterrupt("the Ray simulation was interrupted")
        if self.stopped:
            raise RuntimeError("the Ray simulation runtime stopped")

    def _started(self, run_id: str) -> None:
        self.run_id = run_id
        if self.on_start is not None:
            self.on_start(run_id)


def _backend_config(options: RayOptions, temp_dir: str) -> dict[str, Any]:
    init_args: dict[str, Any] = {"log_to_driver": options.verbose,
                                 "logging_level": "WARNING" if options.verbose else "ERROR"}
    if options.address:  # an existing cluster: its resources and files are its own
        init_args["address"] = options.address
    else:
        init_args.update(address="local", num_cpus=options.cpus(), num_gpus=0, include_dashboard=False,
                         _temp_dir=temp_dir)
    if options.object_store_mb is not None and not options.address:
        init_args["object_store_memory"] = options.object_store_mb * 2**20
    return {"init_args": init_args, "client_resources": {"num_cpus": options.cpus_per_client, "num_gpus": 0}}


class ScenarioClient:
    """Quorum's ClientApp on a Flower virtual node, seeing what it sees in-process.

    For one call the app gets the run config ``run_simulation`` leaves out and
    node id ``partition-id + 1`` (on its ``Context`` and as the destination),
    the id :class:`PartitionGrid` shows the aggregator: training seeds and
    secure-aggregation identities agree. It answers :data:`NODE_INFO` itself.
    """

    def __init__(self, app: ClientApp, run_config: dict[str, str],
                 node_configs: dict[int, dict[str, str]] | None = None) -> None:
        self._app, self._run_config = app, dict(run_config)
        self._node_configs = dict(node_configs or {})  # by logical node id (secagg identities)

    def __call__(self, message: Message, context: Context) -> Message:
        """Run the app on ``message`` as node ``partition-id + 1``; return its reply from Flower's node id."""
        partition = int(context.node_config["partition-id"])
        if message.metadata.message_type == NODE_INFO:
            return Message(RecordDict({"node": ConfigRecord({"partition-id": partition})}), reply_to=message)
        # Flower rejects a context whose run config changed: lend, call, restore.
        real, run_config, node_config = context.node_id, context.run_config, context.node_config
        context.node_id, context.run_config = partition + 1, {**run_config, **self._run_config}
        context.node_config = {**node_config, **self._node_configs.get(partition + 1, {})}
        message.metadata.dst_node_id = partition + 1
        try:
            reply = self._app(message, context)
        finally:
            context.node_id, context.run_config, context.node_config = real, run_config, node_config
            message.metadata.dst_node_id = real
        reply.metadata.__dict__["_src_node_id"] = real  # Flower checks it against the instruction
        return reply


class PartitionGrid(Grid):
    """Flower's grid (``inner``, random node ids) seen with node ids ``partition-id + 1``.

    ``node_map`` maps those logical ids to Flower's. ``faults`` are decided on
    logical ids, so the same nodes vanish, straggle or lie as in-process.
    ``alive`` raises once the runtime underneath is gone.
    """

    def __init__(self, inner: Grid, node_map: dict[int, int], faults: FaultPlan,
                 alive: Callable[[], None] = lambda: None) -> None:
        self._inner, self._alive = inner, alive
        self._to_real = dict(node_map)
        self._to_logical = {real: logical for logical, real in node_map.items()}
        self._faults = faults
        self._sent: dict[str, Message] = {}       # message id -> instruction (logical ids)
        self._dropped: set[str] = set()           # ids that will never be answered
        self._held: dict[str, tuple[float, Message]] = {}  # straggler replies: ready time, reply

    @classmethod
    def discover(cls, inner: Grid, faults: FaultPlan, alive: Callable[[], None] = lambda: None, *,
                 expected: int, timeout_s: float) -> PartitionGrid:
        """Ask every node its partition; fails if a node does not answer in ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(nodes := list(inner.get_node_ids())) < expected and time.monotonic() < deadline:
            alive()
            time.sleep(0.05)
        waiting = set(inner.push_messages([Message(RecordDict(), n, NODE_INFO, group_id="0") for n in nodes]))
        node_map = {}
        while waiting and time.monotonic() < deadline:
            alive()
            for reply in inner.pull_messages(list(waiting)):
                waiting.discard(reply.metadata.reply_to_message_id)
                node = reply.metadata.src_node_id
                if reply.has_error():
                    raise RuntimeError(f"node {node} failed to start: {reply.error.reason}")
                partition = reply.content.config_records["node"]["partition-id"]
                if isinstance(partition, list):
                    raise TypeError(f"node {node} sent a list as its partition-id: {partition!r}")
                node_map[int(partition) + 1] = node
            time.sleep(0.05)
        if len(node_map) != expected:
            raise TimeoutError(f"{len(node_map)} of {expected} simulated nodes answered in {timeout_s:g} s")
        return cls(inner, node_map, faults, alive)

    # -- Grid API ---------------------------------------------------------
    def set_run(self, run: Any) -> None:
        """Set the Flower run on the grid underneath."""
        self._inner.set_run(run)

    @property
    def run(self) -> Any:
        """Return the Flower run of the grid underneath."""
        return self._inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: float | None = None) -> Message:
        """Return a new message of ``message_type`` carrying ``content`` to logical node ``dst_node_id``."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """Return the logical node ids (``partition-id + 1``), sorted."""
        return sorted(self._to_real)

    def expect_cohort(self, server_round: int, stage: str, nodes: Sequence[int]) -> None:
        """Decide which of a round's ``nodes`` vanish at ``stage`` before its messages come in several batches.

        As in-process (:meth:`runtimes.inprocess.InProcessGrid.expect_cohort`).
        """
        self._faults.expect_cohort(server_round, stage, nodes)

    def lost_edges(self, server_round: int, edges: Sequence[int]) -> frozenset[int]:
        """Return which of a round's simulated edge aggregators vanish (``[faults] edges``), as in-process."""
        return self._faults.lost_edges(server_round, edges)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Send each message to its node's Flower id; return the message ids, in order.

        A message the fault plan drops is not sent and gets an id of its own
        that will never be answered.

        Raises
        ------
        ValueError
            A message is for a logical node id this grid does not have.
        """
        self._alive()
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
        """Return the replies to ``message_ids`` that are ready, from logical node ids; each is returned once.

        Corrupt replies are corrupted on arrival; a straggler's reply is held
        back until its delay has passed.
        """
        self._alive()
        wanted = [m for m in message_ids if m not in self._dropped]
        for reply in self._inner.pull_messages([m for m in wanted if m not in self._held]):
            self._arrived(reply)
        now = time.monotonic()
        ready = [m for m in wanted if m in self._held and self._held[m][0] <= now]
        return [self._held.pop(m)[1] for m in ready]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and collect their replies until all are in, settled, or ``timeout`` s passed."""
        replies: list[Message] = []
        owed = Outstanding({m: 0 for m in self.push_messages(messages)})
        collect(self, owed, float("inf") if timeout is None else timeout, lambda _, r: replies.append(r))
        return replies

    def settled(self, message_ids: Iterable[str]) -> bool:
        """Return True when every id left is a dropped message (no reply can come)."""
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
def _first_interrupt_stops(run: _RayRun) -> Iterator[None]:
    """Turn the first SIGINT into a stop the round loop sees at its next poll.

    A ``KeyboardInterrupt`` here would leave a Flower thread in ``ray.get``
    forever. Only on the main thread, under Python's default SIGINT handler.
    """
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is not signal.default_int_handler:
        yield
        return

    def stop(_signum: int, _frame: object) -> None:
        run.stopped = RunStatus.INTERRUPTED
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def _quiet_run(marker: str, verbose: bool) -> Iterator[None]:
    """Quiet Ray and Flower for the block, and tag every Ray process it starts.

    Telemetry off, a marker every Ray process inherits, Flower's log at ERROR
    (its deprecation notice); all restored after, ``PYTHONPATH`` too
    (``init_ray`` overwrites it).
    """
    saved = {k: os.environ.get(k) for k in (*_QUIET_ENV, "PYTHONPATH", MARKER_ENV)}
    os.environ.update({**{k: v for k, v in _QUIET_ENV.items() if k not in os.environ}, MARKER_ENV: marker})
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
