"""The safe, in-process entry point: :func:`secure_sum`.

Runs every client and the server of one round in this process, with no
transport: what tests and the benchmark use, and the reference the Flower
workflow must agree with.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from privacy.secagg.client import client_step
from privacy.secagg.codec import wire_size
from privacy.secagg.config import SecAggConfig
from privacy.secagg.errors import SecAggCryptoError, SecAggProtocolError
from privacy.secagg.identity import MALICIOUS, ClientPolicy, IdentityDirectory, enrol
from privacy.secagg.messages import Request
from privacy.secagg.result import SecureSumResult, ServerTimer, StageStats
from privacy.secagg.server import ServerRound
from privacy.secagg.stage import Stage
from privacy.secagg.state import ClientState

__all__ = ["request_bytes", "secure_sum"]

Clock = Callable[[], float]


def request_bytes(requests: Mapping[int, Request]) -> int:
    """Bytes sent for one stage; a broadcast message is encoded once."""
    sizes: dict[int, int] = {}
    for message in requests.values():
        if id(message) not in sizes:
            sizes[id(message)] = wire_size(message)
    return sum(sizes[id(m)] for m in requests.values())


def _policies(config: SecAggConfig, n: int,
              entropy: Callable[[int], bytes]) -> tuple[dict[int, ClientPolicy], IdentityDirectory | None]:
    """Each simulated client's policy; in the malicious model, a freshly enrolled identity each."""
    if config.threat_model != MALICIOUS:
        return {u: ClientPolicy(config.threat_model) for u in range(n)}, None
    keys, directory = enrol(range(n), entropy)
    return {u: ClientPolicy(MALICIOUS, keys[u], directory) for u in range(n)}, directory


def _run_stage(server: ServerRound, stage: Stage, clients: dict[int, ClientState], drop: set[int],
               vectors: Sequence[np.ndarray], weights: Sequence[float], policies: Mapping[int, ClientPolicy],
               rng: np.random.Generator, entropy: Callable[[int], bytes], clock: Clock) -> StageStats:
    start, timer = clock(), ServerTimer(clock)
    requests: Mapping[int, Request] = timer.run(server.requests)
    up = 0
    for node in sorted(requests.keys() - drop):
        def train(n: int = node) -> tuple[np.ndarray, float]:
            return vectors[n], weights[n]

        try:
            state, reply = client_step(clients.get(node), node, requests[node], entropy=entropy, rng=rng,
                                       train=train, policy=policies[node])
        except (SecAggProtocolError, SecAggCryptoError, ValueError):
            continue  # the client refuses: to the server, a dropout
        clients[node] = state
        up += wire_size(reply)
        try:
            timer.run(server.accept, node, reply)
        except SecAggProtocolError:
            continue
    timer.run(server.close)
    return StageStats(stage, server.completed[stage], up, request_bytes(requests),
                      clock() - start, timer.total)


def secure_sum(vectors: Sequence[np.ndarray], weights: Sequence[float], config: SecAggConfig, *,
               dropouts: Mapping[Stage, set[int]] | None = None, rng: np.random.Generator,
               server_round: int = 1, entropy: Callable[[int], bytes] = os.urandom,
               clock: Clock = time.perf_counter) -> SecureSumResult:
    """Securely sum ``w_i x_i`` over clients ``0..n-1``, all simulated in-process.

    Implements Bonawitz et al., "Practical Secure Aggregation for
    Privacy-Preserving Machine Learning" (CCS 2017) with the neighbour graph
    of Bell et al., "Secure Single-Server Aggregation with (Poly)Logarithmic
    Overhead" (SecAgg+, CCS 2020). In the malicious model (the default) the
    simulated clients are enrolled first, each with a fresh Ed25519 identity
    key, and run the signed, consistency-checked variant (Sec. 6).

    Parameters
    ----------
    vectors : Sequence[np.ndarray]
        One finite 1-D float update per client, all the same length.
    weights : Sequence[float]
        One weight per client (e.g. its example count), capped at
        ``config.max_weight``.
    config : SecAggConfig
        Protocol parameters.
    dropouts : Mapping[Stage, set[int]] | None
        Clients that vanish at a stage: they never answer it (nor later ones).
    rng : np.random.Generator
        Source of the stochastic-rounding noise (never of key material).
    server_round : int
        Round number, bound into every derived key.
    entropy : Callable[[int], bytes]
        Source of key material (``os.urandom``; inject for known answers).
    clock : Callable[[], float]
        Time source for the per-stage timings.

    Returns
    -------
    SecureSumResult
        The sum over the clients whose inputs made it in, and per-stage costs.

    Raises
    ------
    SecAggAborted
        Too few clients survived a stage to finish the round.
    """
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
    lengths = {np.shape(v) for v in vectors}
    if len(lengths) != 1 or len(next(iter(lengths))) != 1:
        raise ValueError("vectors must be 1-D and all the same length")
    policies, directory = _policies(config, len(vectors), entropy)
    server = ServerRound(range(len(vectors)), config, round_id=server_round, entropy=entropy,
                         vector_length=len(vectors[0]) + 1, directory=directory)
    clients: dict[int, ClientState] = {}
    stages = []
    while (stage := server.stage) is not None:
        drop = set((dropouts or {}).get(stage, set()))
        stages.append(_run_stage(server, stage, clients, drop, vectors, weights, policies, rng, entropy, clock))
    total, weight = server.result()
    return SecureSumResult(total, weight, server.survivors, tuple(stages), server.error_bound())
