"""Quorum's Flower ClientApp: local training and evaluation on local data.

The same app runs in every runtime. Its data comes from the node: a
simulated node names its partition of the scenario's data set
(``partition-id`` / ``num-partitions`` in its node config); a real edge device
names its own file (``data-path``), which never leaves the device. The model
and the data are loaded once per process and reused across rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clients.attacks import AttackMod, AttackPlan, flip_labels
from core.messages import TrainConfig, client_seed, eval_reply, parse_instruction, train_reply
from learning.datasets import ClientData, load_client_data
from learning.federation import cached_federation
from learning.models import build_model, get_flat, set_flat
from learning.training import evaluate, train
from privacy.dp import ClientDPConfig, client_payload, secure_rng
from privacy.secagg.flower_mod import secagg_mod
from scenarios.runconfig import scenario_from_run_config
from scenarios.schema import Scenario

__all__ = ["app", "client_mods"]


@dataclass
class _Runtime:
    """What a node keeps between messages: its data and one model instance."""

    data: ClientData
    model: torch.nn.Module


_RUNTIMES: dict[tuple[Any, ...], _Runtime] = {}


def _runtime(context: Context) -> _Runtime:
    """Load (once per process) the node's data and model."""
    scenario = scenario_from_run_config(dict(context.run_config))
    node = dict(context.node_config)
    key = (id(scenario), node.get("partition-id"), node.get("data-path"))
    runtime = _RUNTIMES.get(key)
    if runtime is None:
        runtime = _RUNTIMES[key] = _load_runtime(scenario, node)
    return runtime


def _load_runtime(scenario: Scenario, node: dict[str, Any]) -> _Runtime:
    if "data-path" in node:
        data = load_client_data(str(node["data-path"]), label_column=scenario.data.label_column,
                                test_fraction=scenario.data.client_test_fraction, seed=scenario.seed)
        fed = cached_federation(scenario) if scenario.data.dataset != "file" else None
        shape = fed.input_shape if fed else tuple(data.train.x.shape[1:])
        classes = fed.num_classes if fed else int(data.train.y.max()) + 1
    else:
        fed = cached_federation(scenario)
        data = fed.clients[int(node["partition-id"]) % len(fed.clients)]
        shape, classes = fed.input_shape, fed.num_classes
    model = build_model(scenario.model.name, shape, classes, seed=scenario.seed)
    return _Runtime(data=data, model=model)


def client_mods() -> list[Any]:
    """ClientApp mods: secure aggregation answers its own protocol stages; the
    attack harness (``[faults] byzantine``, off unless a scenario asks) forges
    the train replies of its Byzantine nodes, before secure aggregation masks them."""
    return [secagg_mod, AttackMod(honest=_honest_update, plan_of=_attack_plan)]


def _attack_plan(context: Context) -> AttackPlan:
    return AttackPlan.from_scenario(scenario_from_run_config(dict(context.run_config)))


_HONEST: dict[tuple[Any, ...], tuple[np.ndarray, int, dict[str, float]]] = {}


def _honest_update(partition: int, flip: bool, message: Message,
                   context: Context) -> tuple[np.ndarray, int, dict[str, float]]:
    """An honest copy of this round's training on simulated ``partition`` (labels flipped on request).

    The attack harness's view of honest behaviour; cached per round and process,
    since every colluding attacker asks for the same copies.
    """
    scenario = scenario_from_run_config(dict(context.run_config))
    params, config = parse_instruction(message.content)
    key = (id(scenario), config.round, partition, flip)
    if key not in _HONEST:
        if _HONEST and next(iter(_HONEST))[:2] != key[:2]:
            _HONEST.clear()  # a new round: the old copies are stale
        fed = cached_federation(scenario)
        data = fed.clients[partition % len(fed.clients)].train
        if flip:
            data = replace(data, y=flip_labels(data.y, fed.num_classes))
        model = _runtime(context).model
        set_flat(model, params)
        started = time.monotonic()
        result = train(model, data, epochs=config.epochs, batch_size=config.batch_size, lr=config.lr,
                       momentum=config.momentum, proximal_mu=config.proximal_mu,
                       seed=client_seed(config.seed, config.round, partition + 1))
        metrics = {"train-loss": float(result.loss), "duration-s": time.monotonic() - started}
        _HONEST[key] = (get_flat(model) - params, result.num_examples, metrics)
    return _HONEST[key]


app = ClientApp(mods=client_mods())


@app.train()
def train_handler(message: Message, context: Context) -> Message:
    """Train the global model on local data; reply with the update (a delta)."""
    runtime = _runtime(context)
    params, config = parse_instruction(message.content)
    started = time.monotonic()
    set_flat(runtime.model, params)
    result = _train(runtime, config, client_seed(config.seed, config.round, context.node_id))
    delta = get_flat(runtime.model) - params
    metrics = {"train-loss": float(result.loss), "duration-s": time.monotonic() - started}
    delta, extra = _privatize(delta, config)
    return Message(train_reply(delta, result.num_examples, {**metrics, **extra}), reply_to=message)


def _train(runtime: _Runtime, config: TrainConfig, seed: int) -> Any:
    return train(runtime.model, runtime.data.train, epochs=config.epochs, batch_size=config.batch_size,
                 lr=config.lr, momentum=config.momentum, proximal_mu=config.proximal_mu, seed=seed)


def _privatize(delta: np.ndarray, config: TrainConfig) -> tuple[np.ndarray, dict[str, float]]:
    """Client-level DP: clip, add this client's noise share (distributed placement)
    and append the centred clip bit (adaptive clipping). Nothing about the norm
    goes into the metrics: it would leak. Under secure aggregation every client
    weighs 1, as DP-FedAvg's fixed denominator requires."""
    dp = ClientDPConfig.from_config(config.extra)
    if dp is None:
        return delta, {}
    return client_payload(delta, dp, secure_rng()).astype(np.float32, copy=False), {"secagg-weight": 1.0}


@app.evaluate()
def evaluate_handler(message: Message, context: Context) -> Message:
    """Score the global model on the node's local test split."""
    runtime = _runtime(context)
    params, _ = parse_instruction(message.content)
    set_flat(runtime.model, params)
    result = evaluate(runtime.model, runtime.data.test)
    on_train = evaluate(runtime.model, runtime.data.train)
    reply = eval_reply(result.loss, result.accuracy, result.num_examples, on_train.loss, on_train.num_examples)
    return Message(reply, reply_to=message)
