"""The round loop's train step under secure aggregation.

Same shape as :class:`aggregator.train.PlainTrain`: (sampled clients, global
model) in, a running aggregate and one record per client out. The aggregate
is built from the unmasked weighted sum ``sum_i w_i x_i`` and ``sum_i w_i``,
so the strategy finalises it exactly as it would a plain one; the server never
sees an individual update. Below the threshold the round's training is empty, the
cause (stage and counts) is recorded, and the run goes on with the next round.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from flwr.serverapp import Grid

from core import aggregate
from core.compress import Codec
from core.errors import UpdateRejected
from core.instructions import train_instruction
from core.records import ClientRecord
from core.status import ClientStatus
from core.strategy import Strategy, fold_secure_sum
from core.train import TrainOutcome, TrainRequest
from privacy.secagg.config import SecAggConfig
from privacy.secagg.errors import SecAggAborted, SecAggConfigError
from privacy.secagg.flower_workflow import run_secagg
from privacy.secagg.result import SecureSumResult
from scenarios.threats import SecAggSpec

__all__ = ["SecAggTrain", "config_from_spec"]


def config_from_spec(spec: SecAggSpec) -> SecAggConfig:
    """Build the protocol config for a scenario's ``[secagg]`` section."""
    # 0 means the strict majority floor(m/2) + 1 of each neighbourhood (SecAggConfig's None).
    threshold: int | float | None = (int(spec.threshold) if spec.threshold >= 1
                                     else float(spec.threshold) if spec.threshold > 0 else None)
    return SecAggConfig(threshold=threshold, graph=spec.graph, degree=spec.degree or None,
                        clip_range=spec.clip_range, bits=spec.bits, max_weight=spec.max_weight,
                        stage_timeout_s=spec.stage_timeout_s, client_metrics=spec.client_metrics,
                        threat_model=spec.threat_model)


class SecAggTrain:
    """Train workflow that aggregates through the secure-aggregation protocol."""

    def __init__(self, spec: SecAggSpec, accumulate: str = "float32") -> None:
        self.config = config_from_spec(spec)
        self.accumulate = accumulate  # what the unmasked sum is kept in ([federation] accumulate)

    def __call__(self, grid: Grid, request: TrainRequest, strategy: Strategy[Any]) -> TrainOutcome[Any]:
        """Run one round's train step through the secure-aggregation protocol and fold the secure sum."""
        content = train_instruction(request.state.params, request.config, request.layout)
        rng = np.random.default_rng([request.config.seed, request.server_round, 0x5EC])
        try:
            result = run_secagg(grid, list(request.nodes), content, self.config, server_round=request.server_round,
                                rng=rng)
        except SecAggAborted as exc:
            return self._recorded(_aborted(request, exc))
        except SecAggConfigError as exc:  # the settings were checked up front: this cohort is too small
            return self._recorded(_too_small(request, exc))
        return self._recorded(_outcome(request, result, strategy, self.accumulate))

    def _recorded(self, outcome: TrainOutcome[Any]) -> TrainOutcome[Any]:
        """Record in the round's secagg info which threat model protected it."""
        outcome.secagg = {**(outcome.secagg or {}), "threat_model": self.config.threat_model}
        return outcome


def _stage_table(result: SecureSumResult) -> list[dict[str, Any]]:
    return [{"stage": s.stage.value, "completed": len(s.completed), "bytes_up": s.bytes_up,
             "bytes_down": s.bytes_down, "seconds": round(s.seconds, 4)} for s in result.stages]


def _outcome(request: TrainRequest, result: SecureSumResult, strategy: Strategy[Any],
             accumulate: str = "float32") -> TrainOutcome[Any]:
    survivors = set(result.survivors)
    up, down = _wire_by_node(result)
    clients = [replace(_client_record(node, result, survivors), bytes_in=up.get(node, 0), bytes_out=down.get(node, 0))
               for node in request.nodes]
    agg, refused = _fold_sum(request, result, strategy, accumulate)
    losses = [(m.get("train-loss"), m.get("num-examples", 0)) for m in result.client_metrics.values()]
    losses = [(float(loss), int(n)) for loss, n in losses if isinstance(loss, (int, float)) and n]
    train_loss = float(np.average([loss for loss, _ in losses], weights=[n for _, n in losses])) if losses else None
    return TrainOutcome(
        aggregate=agg, clients=clients, train_loss=train_loss,
        bytes_in=sum(up.values()), bytes_out=sum(down.values()),
        secagg={"stages": _stage_table(result), "survivors": len(survivors),
                "error_bound": float(result.error_bound), **({"refused": refused} if refused else {})})


def _wire_by_node(result: SecureSumResult) -> tuple[dict[int, int], dict[int, int]]:
    """Each client's bytes up and down over the round's stages, as serialised on Flower's wire."""
    up: dict[int, int] = {}
    down: dict[int, int] = {}
    for stage in result.stages:
        for node, n in stage.wire_up.items():
            up[node] = up.get(node, 0) + n
        for node, n in stage.wire_down.items():
            down[node] = down.get(node, 0) + n
    return up, down


def _fold_sum(request: TrainRequest, result: SecureSumResult, strategy: Strategy[Any],
              accumulate: str = "float32") -> tuple[aggregate.MeanState | None, str | None]:
    """Fold the secure sum through the strategy, as the plain path folds each reply.

    The strategy's server-side checks run on what the server actually received.
    A sum of random-k vectors (``[compression] randomk``) is scattered back to
    the model's coordinates first (:meth:`core.compress.Codec.scatter`).
    """
    if not result.survivors:
        return None, None
    try:
        total = result.total.astype(accumulate)
        codec = Codec.from_config(request.config)
        if codec is not None:
            total = codec.scatter(total, strategy.new_aggregate(request.state.params.size).size)
        partial = aggregate.MeanState(total=total, weight=float(result.total_weight), count=len(result.survivors))
        return fold_secure_sum(strategy, request.state.params.size, partial), None
    except UpdateRejected as exc:
        return None, f"secure sum refused: {exc}"


def _client_record(node: int, result: SecureSumResult, survivors: set[int]) -> ClientRecord:
    if node in survivors:
        metrics = dict(result.client_metrics.get(node, {}))
        loss = metrics.get("train-loss")
        return ClientRecord(client=str(node), outcome=ClientStatus.OK, num_examples=int(metrics.get("num-examples", 0)),
                            train_loss=float(loss) if isinstance(loss, (int, float)) else None,
                            duration_s=metrics.get("duration-s"),
                            metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    failed = next((s for s in result.stages if node not in s.completed), None)
    stage = failed.stage.value if failed is not None else "unknown"
    if failed is not None and node in failed.rejected:
        return ClientRecord(client=str(node), outcome=ClientStatus.REJECTED, stage=stage,
                            reason=f"secure-aggregation stage {stage}: {failed.rejected[node]}")
    if failed is not None and node in failed.failed:
        return ClientRecord(client=str(node), outcome=ClientStatus.FAILED, stage=stage, reason=failed.failed[node])
    if failed is not None and node in failed.refused:
        return ClientRecord(client=str(node), outcome=ClientStatus.REFUSED, stage=stage, reason=failed.refused[node])
    return ClientRecord(client=str(node), outcome=ClientStatus.DROPPED, stage=stage,
                        reason=f"no valid reply at secure-aggregation stage {stage}")


def _too_small(request: TrainRequest, exc: SecAggConfigError) -> TrainOutcome[Any]:
    """Skip a round whose sample the protocol cannot run on (a Poisson sample of 0 or 1).

    Nobody is asked to train; the round goes on without updates (skipped; a
    DP strategy still releases and accounts it).
    """
    reason = f"secure aggregation not run for {len(request.nodes)} sampled clients: {exc}"
    clients = [ClientRecord(client=str(n), outcome=ClientStatus.DROPPED, stage="setup", reason=reason)
               for n in request.nodes]
    return TrainOutcome(aggregate=None, clients=clients, secagg={"aborted": reason, "stage": "setup"})


def _aborted(request: TrainRequest, exc: SecAggAborted) -> TrainOutcome[Any]:
    clients = [ClientRecord(client=str(n), outcome=ClientStatus.DROPPED, stage=exc.stage.value, reason=str(exc))
               for n in request.nodes]
    return TrainOutcome(aggregate=None, clients=clients, secagg={"aborted": str(exc), "stage": exc.stage.value})
