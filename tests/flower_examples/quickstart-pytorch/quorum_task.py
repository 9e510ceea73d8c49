"""quickstart-pytorch's model, data and training as a Quorum task: the other way round (Quorum's ClientApp under
the example's own, stock ServerApp).

The example's ``task.py`` is called unchanged: ``Net`` is the model, ``load_data``
the node's partition, ``train`` and ``test`` its training and evaluation, with
the arguments its ``client_app.py`` passes them (the round's ``lr`` from the
server's config, ``local-epochs`` and ``batch-size``, which the scenario's
``[training]`` carries). Moved as docs/tasks.md ("An existing Flower app") says
an app moves.
"""

from __future__ import annotations

from typing import Any

import torch
from pytorchexample.task import Net, load_data
from pytorchexample.task import test as test_fn
from pytorchexample.task import train as train_fn
from torch import nn

from core.instructions import TrainConfig
from learning.task import Metrics, Split, Task

CPU = torch.device("cpu")


class PytorchExampleTask(Task):
    def build_model(self, seed: int) -> nn.Module:
        with torch.random.fork_rng():  # the example's Net, from the run's seed; torch's own generator untouched
            torch.manual_seed(seed)
            return Net()

    def partition(self, partition_id: int) -> Any:
        trainloader, valloader = load_data(partition_id, self.scenario.federation.clients,
                                           self.scenario.training.batch_size)
        return Split(train=trainloader, test=valloader)

    def train(self, model: nn.Module, data: Any, config: TrainConfig, seed: int) -> Metrics:  # noqa: ARG002
        loss = train_fn(model, data, config.epochs, config.lr, CPU)
        return {"loss": loss, "num_examples": len(data.dataset)}

    def evaluate(self, model: nn.Module, data: Any) -> Metrics:
        loss, accuracy = test_fn(model, data, CPU)
        return {"loss": loss, "accuracy": accuracy, "num_examples": len(data.dataset)}

