"""Quorum's Flower ClientApp: local training and evaluation on local data.

The same app runs in every runtime. Its data comes from the node: a
simulated node names its partition of the scenario's data set
(``partition-id`` / ``num-partitions`` in its node config); a real edge device
names its own file (``data-path``), which never leaves the device. A process
builds one model per scenario and serves every node with it (a node's own
buffers travel in its ``context.state``); a simulated node's partition is
materialised when it is sampled and dropped after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from clients.attacks import AttackMod, AttackPlan, flip_labels
from clients.edge import edge_mod, forward
from clients.mods import StatisticsMod, compression_mod, data_view, dp_mod, standardize_mod
from clients.policy.mod import policy_mod
from core.errors import UpdateRejected
from core.eval_replies import eval_reply
from core.instructions import Instruction, TrainConfig, client_seed, control_of, parse_instruction, read_instruction
from core.replies import train_reply
from learning.federation import cached_federation
from learning.models import layout_of
from learning.scaffold import control_update, corrected_gradients
from learning.standardize import (
    Standardization,
    standardized,
)
from learning.task import LocalData, Metrics, Task, TaskModel, load_task
from privacy.dp.dpsgd import train_client
from privacy.dp.rng import secure_rng
from privacy.secagg.flower_mod import secagg_mod
from scenarios.runconfig import scenario_from_run_config
from scenarios.schema import Scenario

__all__ = ["app", "client_mods"]


@dataclass
class _Runtime:
    """What one call works with: the process's model of the scenario's task, and the node's data."""

    data: LocalData
    model: TaskModel
    scenario: Scenario


@dataclass
class _Shared:
    """What a process keeps per scenario.

    One model for every node it serves, and the initial values of the model's
    own buffers (each node's copies live in its state).
    """

    model: TaskModel
    buffers: dict[str, np.ndarray]


_SHARED: dict[int, _Shared] = {}  # by id(scenario): scenario_from_run_config keeps the object alive
_DEVICE_DATA: dict[tuple[int, str, tuple[int, int]], LocalData] = {}  # a device's own file, read again if it changes

#: Where a node keeps its copies of the model's buffers (``context.state``): running statistics
#: and the like are the node's own, as they were when every node had a model of its own.
BUFFERS_KEY = "quorum.buffers"


def _runtime(context: Context) -> _Runtime:
    """Return the process's model (built once per scenario) with this node's buffers, and the node's data.

    The data as this message's mods left them: standardised when the
    instruction says so (:func:`clients.mods.standardize_mod`).

    A simulated node's partition is materialised for this call and dropped
    after it (a virtual client costs nothing until it is sampled); a
    device's own file is read once.
    """
    scenario = scenario_from_run_config(dict(context.run_config))
    task = load_task(scenario)
    data = _node_data(task, scenario, dict(context.node_config))  # first: a device's file shapes its model
    shared = _SHARED.get(id(scenario))
    if shared is None:
        model = TaskModel.build(task, scenario.seed)
        shared = _SHARED[id(scenario)] = _Shared(model, _own_buffers(model))
    _load_buffers(shared, context)
    return _Runtime(data=standardized(data, data_view(context.state)), model=shared.model, scenario=scenario)


def _node_data(task: Task, scenario: Scenario, node: dict[str, Any]) -> LocalData:
    """Return the task's data for this node: a device's own file, or a simulated partition."""
    if "data-path" in node:
        path = str(node["data-path"])
        key = (id(scenario), path, _version(path))
        if key not in _DEVICE_DATA:
            for old in [k for k in _DEVICE_DATA if k[:2] == key[:2]]:
                del _DEVICE_DATA[old]  # the file changed: its old contents go
            _DEVICE_DATA[key] = task.device_data(path)
        return _DEVICE_DATA[key]
    return task.partition(int(node["partition-id"]))


def _version(path: str) -> tuple[int, int]:
    """When and how big the device's data last was: an edited file is read again at the next task.

    A folder (a language-model device's text) counts its newest file.
    """
    try:
        where = Path(path)
        stats = [where.stat()] + ([f.stat() for f in where.iterdir()] if where.is_dir() else [])
    except OSError:
        return (0, 0)  # gone: the task's own read reports it
    return (max(s.st_mtime_ns for s in stats), sum(s.st_size for s in stats))


def _own_buffers(model: TaskModel) -> dict[str, np.ndarray]:
    """Return the saved buffers that do not travel (e.g. batch-norm statistics), at their initial values."""
    buffers = {name for name, _ in model.model.named_buffers()}
    travel = set(model.names)
    return {k: v.detach().cpu().numpy().copy() for k, v in model.model.state_dict().items()
            if k in buffers and k not in travel}


def _load_buffers(shared: _Shared, context: Context) -> None:
    if not shared.buffers:
        return
    kept = context.state.get(BUFFERS_KEY)
    values = {k: kept[k].numpy() for k in kept} if isinstance(kept, ArrayRecord) else shared.buffers
    state = shared.model.model.state_dict()
    with torch.no_grad():
        for name, value in values.items():
            state[name].copy_(torch.from_numpy(np.array(value)))


def _keep_buffers(runtime: _Runtime, context: Context) -> None:
    """Save the node's buffers after it trained (nothing when the model has none that stay home)."""
    shared = _SHARED[id(runtime.scenario)]
    if shared.buffers:
        state = runtime.model.model.state_dict()
        context.state[BUFFERS_KEY] = ArrayRecord({k: Array(state[k].detach().cpu().numpy().copy())
                                                  for k in shared.buffers})


def client_mods() -> list[Any]:
    """Return the ClientApp mods, outermost first: edge, secagg, site policy, attacks, statistics, compression, DP.

    An edge aggregator's messages go to its own ServerApp (``clients.edge``)
    before any device's mod sees them. Secure aggregation answers its own protocol stages and masks the reply
    the mods inside it made; the node's site policy (``clients.policy``)
    refuses a message that breaks it before anything inside reads the node's
    data (inside secure aggregation's mod, it knows when the reply will be
    masked); the attack harness (``[faults] byzantine``, off
    unless a scenario asks) forges the train replies of its Byzantine nodes;
    the statistics mod answers ``[data] standardize``'s passes itself (no
    training, no DP, no compression); compression encodes the update DP
    clipped and noised; standardisation, next to the handlers, hands them the
    node's data as the instruction scales it (``clients.mods``). The train
    handler only trains.
    """
    return [edge_mod, secagg_mod, policy_mod, AttackMod(honest=_honest_update, plan_of=_attack_plan),
            StatisticsMod(features_of=lambda context: _runtime(context).data.train), compression_mod, dp_mod,
            standardize_mod]


def _attack_plan(context: Context) -> AttackPlan:
    return AttackPlan.from_scenario(scenario_from_run_config(dict(context.run_config)))


_HONEST: dict[tuple[Any, ...], tuple[np.ndarray, int, dict[str, float]]] = {}


def _honest_update(partition: int, flip: bool, message: Message,
                   context: Context) -> tuple[np.ndarray, int, dict[str, float]]:
    """Return an honest copy of this round's training on simulated ``partition`` (labels flipped on request).

    The attack harness's view of honest behaviour; cached per round and process,
    since every colluding attacker asks for the same copies.
    """
    scenario = scenario_from_run_config(dict(context.run_config))
    params, config = parse_instruction(message.content)
    key = (id(scenario), config.round, partition, flip)
    if key not in _HONEST:
        if _HONEST and next(iter(_HONEST))[:2] != key[:2]:
            _HONEST.clear()  # a new round: the old copies are stale
        model = _runtime(context).model
        data = standardized(model.task.partition(partition).train, Standardization.from_config(config))
        if flip:  # label flipping: a classification attack, on the federation's classes
            data = replace(data, y=flip_labels(data.y, cached_federation(scenario).num_classes))
        model.set_flat(params)
        started = time.monotonic()
        result = model.train(data, config, client_seed(config.seed, config.round, partition + 1))
        metrics = {"train-loss": result["loss"], "duration-s": time.monotonic() - started}
        _HONEST[key] = (model.get_flat() - params, int(result["num_examples"]), metrics)
    return _HONEST[key]


app = ClientApp(mods=client_mods())
# an edge aggregator's messages (core.partials): registered so Flower routes them; edge_mod answers them first
for _register in (app.train("edge"), app.evaluate("edge"), app.query("edge")):
    _register(forward)


@app.train()
def train_handler(message: Message, context: Context) -> Message:
    """Train the global model on local data; reply with the update (a delta)."""
    runtime = _runtime(context)
    instruction = _read(message, runtime)
    params, config = instruction.params, instruction.config
    started = time.monotonic()
    runtime.model.set_flat(params)
    delta, result, sgd_metrics = _trained(runtime, config, client_seed(config.seed, config.round, context.node_id),
                                          params, context)
    _keep_buffers(runtime, context)
    metrics = {"train-loss": result["loss"], "duration-s": time.monotonic() - started,
               **_named("train-", result), **sgd_metrics}
    return Message(train_reply(delta, int(result["num_examples"]), metrics, answer_to=instruction),
                   reply_to=message)


def _read(message: Message, runtime: _Runtime) -> Instruction:
    """Read the instruction, from Quorum or from a stock Flower server.

    A stock Flower server's is answered in its own layout; the settings it does
    not send are the scenario's.
    """
    t, seed = runtime.scenario.training, runtime.scenario.seed
    defaults = TrainConfig(round=0, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, momentum=t.momentum,
                           seed=seed, steps=t.steps)
    return read_instruction(message.content, layout_of(runtime.model.model, runtime.model.names), defaults)


#: Where a node keeps its SCAFFOLD control variate ``c_i`` between rounds (``context.state``; ``lr * c_i``).
CONTROL_KEY = "quorum.scaffold"


def _trained(runtime: _Runtime, config: TrainConfig, seed: int, params: np.ndarray,
             context: Context) -> tuple[np.ndarray, Metrics, dict[str, float]]:
    """Train from ``params``; the update, the task's metrics and DP-SGD's.

    When the round carries SCAFFOLD's server control variate (``[strategy]
    name = "scaffold"``, :mod:`learning.scaffold`) every gradient is corrected
    by it and the node's own, which stays in the node's state (as the
    compression residual), and the update is the model delta followed by the
    control delta.
    """
    try:
        control = control_of(config, params.size)
    except ValueError as exc:
        raise UpdateRejected(str(exc)) from None
    if control is None:
        result, extra = _train(runtime, config, seed)
        return runtime.model.get_flat() - params, result, extra
    kept = context.state.get(CONTROL_KEY)
    own = kept["c"].numpy() if isinstance(kept, ArrayRecord) and "c" in kept else np.zeros_like(params)
    own = own if own.shape == params.shape else np.zeros_like(params)  # another model's: start again
    with corrected_gradients(runtime.model.model, runtime.model.names, (control - own) / config.lr) as count:
        result, extra = _train(runtime, config, seed)
    delta = runtime.model.get_flat() - params
    own, control_delta = control_update(own, control, delta, count.steps)
    context.state[CONTROL_KEY] = ArrayRecord({"c": Array(own)})
    return np.concatenate([delta, control_delta]), result, extra


def _train(runtime: _Runtime, config: TrainConfig, seed: int) -> tuple[Metrics, dict[str, float]]:
    """Run the task's training, or DP-SGD with its sample-level epsilon when ``[dp] local_dp_sgd`` is on.

    A task allows DP-SGD with ``supports_dp_sgd``. DP-SGD's batches and noise
    come from a secure generator, never from ``seed`` (the server knows it).
    """
    if not runtime.scenario.dp.local_dp_sgd:
        return runtime.model.train(runtime.data.train, config, seed), {}
    result, extra = train_client(runtime.model.model, runtime.data.train, config, runtime.scenario.dp, seed=seed,
                                 rng=secure_rng())
    return {"loss": float(result.loss), "num_examples": float(result.num_examples)}, extra


def _named(prefix: str, metrics: Metrics) -> dict[str, float]:
    """Return a task's own metrics (all but ``loss`` and ``num_examples``), prefixed for the reply."""
    return {prefix + k: v for k, v in metrics.items() if k not in ("loss", "num_examples")}


@app.evaluate()
def evaluate_handler(message: Message, context: Context) -> Message:
    """Score the global model on the node's local test split."""
    runtime = _runtime(context)
    instruction = _read(message, runtime)
    runtime.model.set_flat(instruction.params)
    result = runtime.model.evaluate(runtime.data.test)
    on_train = runtime.model.evaluate(runtime.data.train)
    reply = eval_reply(result["loss"], result.get("accuracy"), int(result["num_examples"]), on_train["loss"],
                       int(on_train["num_examples"]), answer_to=instruction, metrics=result)
    return Message(reply, reply_to=message)
