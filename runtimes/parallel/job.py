"""One data-parallel job on one rank: its data, model, trainer, and one round at a time.

Both modes commit *rounds* to the run store. A synchronous round is
``training.local_epochs`` epochs over every rank's shard; a local-SGD round is
one federated round (see :mod:`runtimes.parallel.localsgd`). After training,
each rank scores the new model on the test and training splits of the
clients it trained (the federated evaluation), and the per-client figures of
the round travel to every rank in one small all-reduce of a table with one
row per client (or per rank in synchronous mode).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from aggregator.serverapp import build_strategy
from aggregator.step import train_config
from core import strategy as strategies
from core.status import RoundStatus
from core.strategy import ServerState, Strategy, bind_cohort
from learning.datasets import Federation
from learning.federation import build_federation
from learning.models import build_model, get_flat, set_flat
from learning.training import evaluate
from runtimes.parallel.comm import Comm
from runtimes.parallel.errors import ParallelError
from runtimes.parallel.hooks import HookedSyncSGD
from runtimes.parallel.localsgd import finish_round, local_updates, owned_nodes, round_nodes
from runtimes.parallel.mode import CommHook, Mode
from runtimes.parallel.shards import assign_clients, epoch_order, shard_sizes, steps_per_epoch, union
from runtimes.parallel.sync import SyncSGD, run_epoch
from scenarios.schema import Scenario

__all__ = ["JobSpec", "Job", "RoundResult", "check_scenario", "build_job", "initial_state", "adopt", "run_round",
           "COLUMNS"]

# Columns of the per-round table: one row per client (local SGD) or per rank (sync).
COLUMNS = ("present", "examples", "loss_sum", "duration_s", "eval_n", "eval_loss_sum", "eval_correct",
           "train_eval_n", "train_eval_loss_sum")
_C = {name: i for i, name in enumerate(COLUMNS)}


@dataclass(frozen=True)
class JobSpec:
    """What to train and how."""

    scenario: Scenario
    mode: Mode = Mode.SYNC
    local_steps: int = 0  # local SGD only: H steps per client instead of local_epochs
    comm_hook: CommHook = CommHook.NONE  # sync only: torch's DDP gradient compression instead of the core's


@dataclass
class Job:
    """Everything one rank holds for the whole run."""

    spec: JobSpec
    comm: Comm
    fed: Federation
    model: nn.Module
    strategy: Strategy[Any]
    clients: list[int]                 # client indices this rank owns
    trainer: SyncSGD | HookedSyncSGD | None = None
    shard: tuple[torch.Tensor, torch.Tensor] | None = None
    sizes: list[int] = field(default_factory=list)
    residuals: dict[int, np.ndarray] = field(default_factory=dict)  # localsgd + [compression]: per owned node

    @property
    def scenario(self) -> Scenario:
        """Return the scenario the job trains."""
        return self.spec.scenario

    @property
    def rows(self) -> int:
        """Return the rows of the per-round table: one per rank in sync mode, else one per client."""
        return self.comm.world if self.spec.mode is Mode.SYNC else self.fed.num_clients

    def row_labels(self) -> list[str]:
        """Return the rows' labels: ``rank-<r>`` in sync mode, else the node ids 1..n."""
        if self.spec.mode is Mode.SYNC:
            return [f"rank-{r}" for r in range(self.comm.world)]
        return [str(node) for node in range(1, self.fed.num_clients + 1)]


@dataclass(frozen=True)
class RoundResult:
    """What one round produced, identical on every rank."""

    state: ServerState
    status: str            # ok | skipped | empty (as the federated round loop records it)
    table: np.ndarray      # (rows, len(COLUMNS)), summed over ranks
    bytes_sent: int        # payload this rank gave to collectives this round
    steps: int


def check_scenario(scenario: Scenario, mode: Mode, world: int) -> None:
    """Refuse what the parallel mode cannot run, naming the key.

    Raises
    ------
    ParallelError
        More workers than clients, DP in synchronous mode, secure aggregation,
        a task of the user's own (``[task] entry``), ``[faults]``.
    """
    if scenario.task.entry:
        raise ParallelError(f"{scenario.name}: task.entry = {scenario.task.entry!r}: the data-parallel mode trains "
                            "the built-in classification task ([data] and [model]) only; run this task with "
                            "quorum simulate or a deployment")
    assign_clients(scenario.federation.clients, world)
    if scenario.asynchronous.enabled:
        raise ParallelError(f"{scenario.name}: async.enabled = true: buffered asynchronous aggregation runs on the "
                            "in-process engine's virtual clock (quorum simulate), not across workers")
    if scenario.dp.enabled and mode is Mode.SYNC:
        raise ParallelError(f"{scenario.name}: dp.enabled = true: client-level DP clips and noises each client's "
                            "update, which only the localsgd mode makes; use --mode localsgd")
    if scenario.dp.local_dp_sgd and mode is Mode.SYNC:
        raise ParallelError(f"{scenario.name}: dp.local_dp_sgd = true: DP-SGD trains each client on its own, "
                            "which only the localsgd mode does; use --mode localsgd")
    if scenario.secagg.enabled:
        raise ParallelError(f"{scenario.name}: secagg.enabled = true: secure aggregation protects clients from the "
                            "aggregator; inside one cluster there is no such boundary, turn it off to run parallel")
    if scenario.strategy.name == "scaffold":
        raise ParallelError(f"{scenario.name}: strategy.name = 'scaffold': its control variates live in the "
                            "ClientApp's node state, which the data-parallel mode does not run; use quorum simulate")
    if scenario.training.local_steps is not None and mode is Mode.SYNC:
        raise ParallelError(f"{scenario.name}: training.local_steps = {scenario.training.local_steps}: a sync round "
                            "is training.local_epochs passes over every rank's shard; use --mode localsgd")
    _check_compression(scenario, mode)
    _check_faults(scenario)


def _check_faults(scenario: Scenario) -> None:
    """``[faults]`` acts on the messages of a round's ClientApps, which no rank sends: refuse it by key."""
    faults = scenario.faults
    byzantine = "faults.byzantine" if isinstance(faults.byzantine, float) else "faults.byzantine.fraction"
    candidates = [(byzantine, faults.byzantine_spec.fraction), ("faults.stragglers", faults.stragglers),
                  *((f"faults.dropouts.{stage}", frac) for stage, frac in faults.dropouts.items())]
    set_keys = [(key, value) for key, value in candidates if value]
    if set_keys:
        key, value = set_keys[0]
        raise ParallelError(f"{scenario.name}: {key} = {value!r}: the fault injectors and the attack harness act "
                            "on the messages a round sends to its ClientApps, which the data-parallel mode does "
                            "not send; run this scenario with quorum simulate, or remove [faults]")


def _check_compression(scenario: Scenario, mode: Mode) -> None:
    spec = scenario.compression
    if spec.downlink_bits != 32:
        raise ParallelError(f"{scenario.name}: compression.downlink_bits = {spec.downlink_bits}: the data-parallel "
                            "mode sends no model down (every rank holds it); set it to 32")
    if spec.uplink and mode is Mode.SYNC:
        raise ParallelError(f"{scenario.name}: [compression] compresses client updates, which only the localsgd "
                            "mode makes; the sync mode compresses gradients with --comm-hook fp16 or powersgd")


def build_job(spec: JobSpec, comm: Comm) -> Job:
    """Load the scenario's federation and build this rank's model, shard and trainer."""
    scenario = spec.scenario
    check_scenario(scenario, spec.mode, comm.world)
    fed = build_federation(scenario.data, scenario.federation.clients, scenario.seed)
    mine = assign_clients(fed.num_clients, comm.world)[comm.rank]
    model = build_model(scenario.model.name, fed.input_shape, fed.num_classes, seed=scenario.seed)
    job = Job(spec=spec, comm=comm, fed=fed, model=model, strategy=build_strategy(scenario), clients=mine)
    if spec.mode is Mode.SYNC:
        t = scenario.training
        data = union([fed.clients[c].train for c in mine])
        job.shard = (torch.from_numpy(data.x), torch.from_numpy(data.y))
        job.sizes = shard_sizes(fed, comm.world)
        job.trainer = (SyncSGD(model, comm, lr=t.lr, momentum=t.momentum) if spec.comm_hook is CommHook.NONE
                       else HookedSyncSGD(model, comm, spec.comm_hook, fed.input_shape, lr=t.lr,
                                          momentum=t.momentum))
    return job


def initial_state(job: Job) -> ServerState:
    """Return the state before round 1: the model's weights through the strategy (sync: no slots)."""
    return strategies.initial_state(job.strategy, get_flat(job.model))


def adopt(job: Job, state: ServerState) -> None:
    """Load a (broadcast, resumed) state into this rank's model and optimiser."""
    set_flat(job.model, state.params)
    momentum = state.slots.get("sgd_momentum")
    if job.trainer is not None and momentum is not None:
        job.trainer.load_momentum(momentum)


def run_round(job: Job, state: ServerState, server_round: int) -> RoundResult:
    """Train one round, evaluate it federatedly, and share the per-client table.

    Federated evaluation follows the round loop: the clients that trained (or
    all, with ``evaluation.clients = "all"``) score the new model on their
    test split and on their training split; the round's train loss is then the
    latter, else the mean of the clients' last-epoch training losses.
    """
    sent, table = job.comm.bytes_sent, np.zeros((job.rows, len(COLUMNS)))
    status: str  # a RoundStatus value, as RoundResult records it
    if job.spec.mode is Mode.SYNC:
        state, status = _sync_round(job, server_round, table), RoundStatus.OK
        t = job.scenario.training
        steps = t.local_epochs * steps_per_epoch(job.sizes, t.batch_size)
        evals = {job.comm.rank: job.clients}
    else:
        state, status, evals = _local_round(job, state, server_round, table)
        steps = 0
    if _evaluates(job.scenario, server_round):
        _evaluate_rows(job, state, evals, table)
    job.comm.where = f"round {server_round} metrics"
    tensor = torch.from_numpy(table)
    job.comm.sum_(tensor)
    return RoundResult(state, status, table, job.comm.bytes_sent - sent, steps)


def _sync_round(job: Job, server_round: int, table: np.ndarray) -> ServerState:
    t, comm, trainer = job.scenario.training, job.comm, job.trainer
    if trainer is None or job.shard is None:
        raise ParallelError("a sync round needs the trainer and shard that build_job makes in sync mode")
    x, y = job.shard
    steps = steps_per_epoch(job.sizes, t.batch_size)
    started, loss = time.monotonic(), 0.0
    for k in range(t.local_epochs):
        epoch = (server_round - 1) * t.local_epochs + k + 1
        order = epoch_order(len(y), job.scenario.seed, epoch, comm.rank)
        loss = run_epoch(trainer, x, y, order, steps, label=f"round {server_round} epoch {k + 1}", sizes=job.sizes)
    row = table[comm.rank]
    row[[_C["present"], _C["examples"], _C["loss_sum"]]] = 1, len(y), loss  # loss of the last epoch
    row[_C["duration_s"]] = time.monotonic() - started
    momentum = trainer.momentum()
    slots = {} if momentum is None else {"sgd_momentum": momentum}
    return ServerState(params=get_flat(job.model), slots=slots, round=server_round)


def _local_round(job: Job, state: ServerState, server_round: int,
                 table: np.ndarray) -> tuple[ServerState, str, dict[int, list[int]]]:
    comm, scenario = job.comm, job.scenario
    strategy = job.strategy.for_round(state)
    comm.where = f"round {server_round} sampling"
    nodes = comm.broadcast_json(round_nodes(strategy, scenario, server_round) if comm.rank == 0 else None)
    strategy = bind_cohort(strategy, len(nodes))
    mine = owned_nodes(nodes, comm.rank, comm.world)
    config = train_config(scenario, strategy, server_round)
    agg, runs = local_updates(job.model, job.fed, strategy, state, mine, config, job.spec.local_steps,
                              scenario.dp, job.residuals)
    for run in runs:
        table[run.node - 1, [_C["present"], _C["examples"], _C["loss_sum"], _C["duration_s"]]] = (
            1, run.num_examples, run.loss * run.num_examples, run.duration_s)
    comm.where = f"round {server_round} model averaging"
    new, status = finish_round(comm, strategy, state, comm.merge(agg), scenario, server_round)
    if scenario.evaluation.clients == "all":
        mine = owned_nodes(range(1, job.fed.num_clients + 1), comm.rank, comm.world)
    return new, status, {n - 1: [n - 1] for n in mine}


def _evaluates(scenario: Scenario, server_round: int) -> bool:
    ev = scenario.evaluation
    return ev.federated and (server_round % ev.every == 0 or server_round == scenario.rounds)


def _evaluate_rows(job: Job, state: ServerState, evals: dict[int, list[int]], table: np.ndarray) -> None:
    """Score the round's model on each row's clients, test and train splits, as the ClientApp does."""
    set_flat(job.model, state.params)
    for row, clients in evals.items():
        test = [job.fed.clients[c].test for c in clients if len(job.fed.clients[c].test)]
        if test:
            result = evaluate(job.model, union(test))
            n = result.num_examples
            table[row, [_C["eval_n"], _C["eval_loss_sum"], _C["eval_correct"]]] = (
                n, result.loss * n, result.accuracy * n)
        on_train = evaluate(job.model, union([job.fed.clients[c].train for c in clients]))
        table[row, [_C["train_eval_n"], _C["train_eval_loss_sum"]]] = (
            on_train.num_examples, on_train.loss * on_train.num_examples)
