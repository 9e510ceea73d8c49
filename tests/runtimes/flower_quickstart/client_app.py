"""A user's Flower 1.42 ClientApp, written the way Flower's own quickstart writes it.

``@app.train()`` / ``@app.evaluate()`` read ``msg.content["arrays"]`` and
``msg.content["config"]["lr"]`` and answer an ``ArrayRecord`` named ``arrays``
plus a ``MetricRecord`` with ``num-examples``; :class:`LegacyClient` is the
same code as a legacy ``NumPyClient`` behind a ``client_fn``. Nothing here
knows Quorum's message layout. The model is McMahan's 2NN on sklearn digits;
the data loader hands out the run's scenario partitions (as a user's
``load_data(partition_id, num_partitions)`` would hand out theirs), and the
shuffle is seeded from Flower's ``server-round`` and the node id the way
Quorum's own client seeds it, so a run with this client and one with
Quorum's differ only in the wire path.

Used in-process by ``tests/runtimes/test_flower_compat.py`` and, as the
ClientApp of this directory's Flower app, through ``flwr run`` on a SuperLink
by ``tests/runtimes/test_deployment.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from torch import nn

from core.instructions import client_seed
from learning.federation import cached_federation
from scenarios.runconfig import scenario_from_run_config

Data = tuple[torch.Tensor, torch.Tensor]


class Net(nn.Sequential):
    """McMahan et al.'s 2NN: 64-200-200-10 on 8x8 digits."""

    def __init__(self) -> None:
        super().__init__(nn.Flatten(), nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                         nn.Linear(200, 10))


def load_data(run_config: dict[str, Any], partition_id: int, split: str) -> Data:
    part = getattr(cached_federation(scenario_from_run_config(run_config)).clients[partition_id], split)
    return torch.as_tensor(part.x, dtype=torch.float32), torch.as_tensor(part.y, dtype=torch.long)


def shuffle_seed(run_config: dict[str, Any], server_round: int, node_id: int) -> int:
    return client_seed(scenario_from_run_config(run_config).seed, server_round, node_id)


def train_fn(net: nn.Module, data: Data, epochs: int, lr: float, batch_size: int, seed: int) -> float:
    x, y = data
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    net.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        xs, ys = x[order], y[order]
        for start in range(0, len(ys), batch_size):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(xs[start:start + batch_size]), ys[start:start + batch_size])
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
    return total / steps


def score_fn(net: nn.Module, data: Data) -> tuple[float, float]:
    x, y = data
    net.eval()
    with torch.no_grad():
        out = net(x)
    return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    run_config = dict(context.run_config)
    data = load_data(run_config, int(context.node_config["partition-id"]), "train")
    config = msg.content["config"]
    train_loss = train_fn(model, data, int(run_config["local-epochs"]), float(config["lr"]),
                          int(run_config["batch-size"]),
                          shuffle_seed(run_config, int(config["server-round"]), context.node_id))
    metrics = {"train_loss": train_loss, "num-examples": len(data[0])}
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = load_data(dict(context.run_config), int(context.node_config["partition-id"]), "test")
    eval_loss, eval_acc = score_fn(model, data)
    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(data[0])}
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


class LegacyClient(NumPyClient):
    def __init__(self, run_config: dict[str, Any], partition_id: int, node_id: int) -> None:
        self.net, self.run_config, self.partition_id, self.node_id = Net(), run_config, partition_id, node_id

    def get_parameters(self, config):  # noqa: ARG002 (NumPyClient's signature)
        return [val.cpu().numpy() for _, val in self.net.state_dict().items()]

    def set_parameters(self, parameters) -> None:
        params_dict = zip(self.net.state_dict().keys(), parameters, strict=True)
        self.net.load_state_dict(OrderedDict({k: torch.tensor(v) for k, v in params_dict}), strict=True)

    def fit(self, parameters, config):
        self.set_parameters(parameters)
        data = load_data(self.run_config, self.partition_id, "train")
        loss = train_fn(self.net, data, int(self.run_config["local-epochs"]), float(config["lr"]),
                        int(self.run_config["batch-size"]),
                        shuffle_seed(self.run_config, int(config["server-round"]), self.node_id))
        return self.get_parameters(config={}), len(data[0]), {"train_loss": loss}

    def evaluate(self, parameters, config):  # noqa: ARG002 (NumPyClient's signature)
        self.set_parameters(parameters)
        data = load_data(self.run_config, self.partition_id, "test")
        loss, accuracy = score_fn(self.net, data)
        return loss, len(data[0]), {"accuracy": accuracy}


def client_fn(context: Context):
    return LegacyClient(dict(context.run_config), int(context.node_config["partition-id"]),
                        context.node_id).to_client()


legacy_app = ClientApp(client_fn=client_fn)
