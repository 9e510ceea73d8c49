"""Local SGD / FedAvg over ranks: the federated round, with the ranks as its transport.

One round ``k`` does what :class:`aggregator.rounds.RoundLoop` does in-process,
step for step:

1. the strategy, bound to the round (``for_round``), samples the clients on
   rank 0 (``strategy.sample``; node ``n`` is client ``n - 1``, as in the
   in-process runtime) and rank 0 broadcasts the sample: a DP strategy samples
   from a secure generator that only one process may draw from;
2. each rank trains the sampled clients it owns (:func:`~runtimes.parallel.shards.owner`),
   each from the global model, with ``learning.training.train`` (``E`` local
   epochs) or :func:`train_steps` (``H`` local steps) and the seed
   ``client_seed(seed, k, n)``, privatises the delta as the ClientApp does
   when the strategy asks for client-side DP, and folds it into its partial
   aggregate with ``strategy.accumulate``;
3. one all-reduce merges the partial aggregates (:meth:`Comm.merge`);
4. rank 0 finalizes with the strategy's round generator (DP noise is drawn
   once, by one process) and broadcasts the mean update; every rank applies
   the strategy (server optimiser) to it, so all ranks hold the same state.

With every client sampled and one rank per client this is local SGD with
periodic model averaging (Stich, "Local SGD Converges Fast and Communicates
Little", ICLR 2019); in general it is FedAvg (McMahan et al., AISTATS 2017,
Algorithm 1) spread over the ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from aggregator.step import advance
from core import aggregate
from core.compress import Codec, with_feedback
from core.instructions import TrainConfig, client_seed
from core.strategy import ServerState, Strategy, round_rng, sample_clients
from learning.datasets import ArrayDataset, Federation
from learning.models import get_flat, set_flat
from learning.training import TrainResult, train
from privacy.dp.dpsgd import train_client
from privacy.dp.mechanisms import ClientDPConfig, client_payload
from privacy.dp.rng import secure_rng
from runtimes.parallel.comm import Comm
from runtimes.parallel.errors import ParallelError
from runtimes.parallel.shards import owner
from scenarios.schema import Scenario
from scenarios.threats import DPSpec

__all__ = ["ClientRun", "round_nodes", "owned_nodes", "train_steps", "local_updates", "finish_round"]


@dataclass(frozen=True)
class ClientRun:
    """What one client's local training produced on this rank."""

    node: int
    num_examples: int
    loss: float
    duration_s: float


def round_nodes(strategy: Strategy[Any], scenario: Scenario, server_round: int) -> list[int]:
    """Return the node ids ``strategy`` (bound to the round) samples, as the federated round loop asks it."""
    nodes = list(range(1, scenario.federation.clients + 1))
    return [int(n) for n in sample_clients(strategy, nodes, scenario.federation.per_round, scenario.seed, server_round)]


def owned_nodes(nodes: Sequence[int], rank: int, world: int) -> list[int]:
    """Return the nodes among ``nodes`` that ``rank`` trains."""
    return [n for n in nodes if owner(n - 1, world) == rank]


def train_steps(model: nn.Module, data: ArrayDataset, *, steps: int, batch_size: int, lr: float,
                momentum: float = 0.0, proximal_mu: float = 0.0, seed: int) -> TrainResult:
    """Take ``steps`` SGD steps, visiting the data exactly as ``learning.training.train`` does.

    Each pass draws a fresh ``randperm`` from one generator seeded with
    ``seed`` and takes consecutive batches (the last of a pass may be
    smaller); a pass cut short by ``steps`` ends the call. With
    ``steps = E * ceil(n / batch_size)`` this is ``train(..., epochs=E)``.
    Returns the example-weighted mean loss over all steps.
    """
    if steps < 1 or len(data) == 0:
        raise ValueError(f"need steps >= 1 and data, got {steps} steps and {len(data)} examples")
    x, y = (torch.from_numpy(np.require(a, requirements=["C", "W"])) for a in (data.x, data.y))
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else None
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    done, total, seen = 0, 0.0, 0
    while done < steps:
        order = torch.randperm(len(y), generator=generator)
        xs, ys = x[order], y[order]
        for start in range(0, len(ys), batch_size):
            if done == steps:
                break
            total += _sgd_step(model, optimizer, xs[start:start + batch_size], ys[start:start + batch_size],
                               params, anchor, proximal_mu)
            seen += len(ys[start:start + batch_size])
            done += 1
    return TrainResult(loss=total / seen, num_examples=len(data), steps=steps)


def _sgd_step(model: nn.Module, optimizer: torch.optim.Optimizer, xb: torch.Tensor, yb: torch.Tensor,
              params: list[nn.Parameter], anchor: list[torch.Tensor] | None, mu: float) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    if anchor is not None:
        with torch.no_grad():
            for p, p0 in zip(params, anchor, strict=True):
                if p.grad is None:  # a parameter the loss does not reach (as learning.training does)
                    p.grad = torch.zeros_like(p)
                p.grad.add_(p - p0, alpha=mu)
    optimizer.step()
    return float(loss.item()) * len(yb)


def _train_client(model: nn.Module, data: ArrayDataset, config: TrainConfig, seed: int,
                  local_steps: int, dp: DPSpec | None = None) -> TrainResult:
    if dp is not None and dp.local_dp_sgd:  # as the ClientApp: DP-SGD over the round's epochs
        return train_client(model, data, config, dp, seed=seed, rng=secure_rng())[0]
    common: dict[str, Any] = dict(batch_size=config.batch_size, lr=config.lr, momentum=config.momentum,
                                  proximal_mu=config.proximal_mu, seed=seed)
    steps = local_steps or config.steps  # the command line's --local-steps, else [training] local_steps
    if steps:
        return train_steps(model, data, steps=steps, **common)
    return train(model, data, epochs=config.epochs, **common)


def _privatize(delta: np.ndarray, config: TrainConfig) -> np.ndarray:
    """Client-side DP exactly as the ClientApp applies it (clip, noise share, clip bit)."""
    if not config.settings:
        return delta
    dp = ClientDPConfig.from_config(config)
    return delta if dp is None else client_payload(delta, dp, secure_rng()).astype(np.float32, copy=False)


def _compressed(node: int, update: np.ndarray, config: TrainConfig,
                residuals: dict[int, np.ndarray] | None) -> np.ndarray:
    """``update`` as the aggregator decodes it under the round's codec (itself without one)."""
    codec = Codec.from_config(config)
    if codec is None:
        return update
    kept = {} if residuals is None else residuals
    rng = np.random.default_rng([config.seed, config.round, node, 0xC0DE])  # as the ClientApp draws them
    arrays, left = with_feedback(codec, update, kept.get(node), rng)
    if left is not None:
        kept[node] = left
    return codec.decode(arrays, update.size)


def local_updates(model: nn.Module, fed: Federation, strategy: Strategy[Any], state: ServerState,
                  nodes: Sequence[int], config: TrainConfig, local_steps: int = 0, dp: DPSpec | None = None,
                  residuals: dict[int, np.ndarray] | None = None) -> tuple[aggregate.MeanState, list[ClientRun]]:
    """Train each of ``nodes`` from ``state`` and fold their updates: this rank's partial aggregate.

    With ``[compression]`` (the round's codec in ``config``) each client's update
    is what the aggregator would decode from it, :mod:`core.compress`'s same
    encoder and decoder, and its error-feedback residual is kept in
    ``residuals`` (per node, on the rank that owns it) for its next round.
    """
    agg = strategy.new_aggregate(state.params.size)
    if type(agg) is not aggregate.MeanState:
        raise ParallelError(f"strategy {strategy.name!r} aggregates into a {type(agg).__name__}, which the "
                            "parallel mode cannot all-reduce; it needs the core's MeanState")
    runs = []
    for node in nodes:
        started = time.monotonic()
        set_flat(model, state.params)
        seed = client_seed(config.seed, config.round, node)
        result = _train_client(model, fed.clients[node - 1].train, config, seed, local_steps, dp)
        update = _compressed(node, _privatize(get_flat(model) - state.params, config), config, residuals)
        duration = time.monotonic() - started
        agg = strategy.accumulate(agg, update, result.num_examples, checked=True)
        runs.append(ClientRun(node, result.num_examples, float(result.loss), duration))
    return agg, runs


def finish_round(comm: Comm, strategy: Strategy[Any], state: ServerState, agg: aggregate.MeanState,
                 scenario: Scenario, server_round: int) -> tuple[ServerState, str]:
    """Run the federated round step (:func:`aggregator.step.advance`) across ranks.

    Rank 0 finalizes the merged aggregate and shares the mean; every rank applies it.
    """

    def shared_mean(merged: aggregate.MeanState) -> np.ndarray:
        # finalize may return more than the aggregate (DP appends its contributor count): rank 0 says how much
        final = strategy.finalize(merged, round_rng(strategy, scenario.seed, server_round)) if comm.rank == 0 else None
        comm.where = f"round {server_round} mean update"
        mean = torch.zeros(int(comm.broadcast_json(None if final is None else int(final.size))), dtype=torch.float32)
        if final is not None:
            mean.numpy()[:] = final
        comm.broadcast_(mean)
        return mean.numpy()

    return advance(strategy, state, agg, min_clients=scenario.federation.min_clients, server_round=server_round,
                   mean_of=shared_mean)
