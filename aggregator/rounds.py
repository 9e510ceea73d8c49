"""The round loop: the one owner of the federated loop.

Each round: sample clients (seeded by the run seed and the round, so a resumed
run samples exactly as an uninterrupted one), run the train workflow (plain or
secure), finalize the aggregate through the strategy, apply the server
optimiser, evaluate, and commit the round with its checkpoint in one store
transaction. Budget checks (differential privacy) happen before a round
starts, never after it has spent privacy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from flwr.serverapp import Grid

from aggregator.evaluation import EvalSummary, EvaluateWorkflow, ServerEvaluator, federated_evaluate, task_round_metrics
from aggregator.step import advance, train_config
from core.aggregate import step_problem
from core.buffer import Marked
from core.instructions import COHORT, TrainConfig
from core.layouts import ParamLayout
from core.outcomes import DROPPED, FAILED, OK, REFUSED, REJECTED
from core.records import ClientRecord, RoundRecord
from core.status import ClientStatus, RoundStatus, RunStatus
from core.strategy import (
    ServerState,
    Strategy,
    bind_cohort,
    round_metrics,
    round_rng,
    sample_clients,
    would_exceed_budget,
)
from core.strategy import epsilon as spent_epsilon
from core.train import TrainOutcome, TrainRequest, TrainWorkflow
from learning.standardize import Standardization
from runstore.runlog import RunLog
from scenarios.schema import Scenario

__all__ = ["RoundLoop", "LoopResult"]


@dataclass(frozen=True)
class LoopResult:
    """How a round loop ended: its last state, its status and its last round's record."""

    state: ServerState
    status: str  # finished | stopped_budget | failed (run_federation refines finished: degraded, failed)
    last: RoundRecord | None


#: The least time federated evaluation gets when training used up the round's deadline (seconds).
EVAL_FLOOR_S = 10.0


@dataclass
class RoundLoop:
    """Runs rounds ``state.round + 1 .. scenario.rounds`` for one stored run."""

    scenario: Scenario
    strategy: Strategy[Any]
    train: TrainWorkflow
    runlog: RunLog  # the stored run it logs and commits to (runstore.runlog)
    server_eval: ServerEvaluator | None = None
    on_round: Callable[[RoundRecord], None] | None = None
    eval_deadline_s: float = 30.0
    layout: ParamLayout | None = None  # the model's tensors, as they travel (see TrainRequest.layout)
    standardization: Standardization | None = None  # [data] standardize = "federated": sent with every instruction
    app_config: Mapping[str, float | int | bool | str] = field(default_factory=dict)  # TrainConfig.app: a Flower app's
    evaluate: EvaluateWorkflow = federated_evaluate  # federated evaluation: straight to the devices, or through edges

    def run(self, grid: Grid, state: ServerState) -> LoopResult:
        """Run the rounds after ``state.round`` up to ``scenario.rounds``.

        Stops early, ``stopped_budget``, when the next round would exceed the
        privacy budget; else ends ``finished``.
        """
        last = None
        while state.round < self.scenario.rounds:
            if would_exceed_budget(self.strategy, state):
                self.runlog.log(f"privacy budget reached before round {state.round + 1}; stopping")
                return LoopResult(state, RunStatus.STOPPED_BUDGET, last)
            state, last = self.run_round(grid, state)
        return LoopResult(state, RunStatus.FINISHED, last)

    def run_round(self, grid: Grid, state: ServerState) -> tuple[ServerState, RoundRecord]:
        """Run round ``state.round + 1``: sample, train, apply, evaluate, then commit it to the store.

        Returns the new state and the round's record (also passed to
        ``on_round``).
        """
        server_round = state.round + 1
        started, t0 = time.time(), time.monotonic()
        fed = self.scenario.federation
        strategy = self.strategy.for_round(state)
        nodes = sample_clients(strategy, list(grid.get_node_ids()), fed.per_round, self.scenario.seed, server_round)
        strategy = bind_cohort(strategy, len(nodes))
        request = TrainRequest(server_round=server_round, nodes=nodes, state=state,
                             config=self._train_config(strategy, server_round).with_settings({COHORT: len(nodes)}),
                             deadline_s=fed.deadline_s, max_update_bytes=int(fed.max_update_mb * 2**20),
                             layout=self.layout)
        outcome = self.train(grid, request, strategy)
        state, status = self._apply(strategy, state, outcome, server_round)
        state, status, reason = self._guard(request.state, state, status, server_round)
        record = self._evaluate_and_record(grid, state, outcome, nodes, server_round, started, t0, status)
        if reason is not None:
            record = replace(record, metrics={**(record.metrics or {}), "reason": reason})
        self.runlog.commit(record, state)
        if self.on_round is not None:
            self.on_round(record)
        return state, record

    def _train_config(self, strategy: Strategy[Any] | None, server_round: int) -> TrainConfig:
        config = train_config(self.scenario, strategy, server_round)
        if self.app_config:
            config = replace(config, app=dict(self.app_config))
        if self.standardization is None:
            return config
        return config.with_settings(self.standardization.to_settings())

    def _apply(self, strategy: Strategy[Any], state: ServerState, outcome: TrainOutcome[Any],
               server_round: int) -> tuple[ServerState, str]:
        min_clients = self.scenario.federation.min_clients
        new, status = advance(strategy, state, outcome.aggregate, min_clients=min_clients, server_round=server_round,
                              mean_of=lambda agg: strategy.finalize(agg, round_rng(strategy, self.scenario.seed,
                                                                                             server_round)))
        if status == RoundStatus.SKIPPED:
            answered = outcome.aggregate.count if outcome.aggregate is not None else 0
            self.runlog.log(f"round {server_round}: {answered} usable updates, fewer than "
                           f"min_clients = {min_clients}; model unchanged", "warning")
        return new, status

    def _guard(self, before: ServerState, after: ServerState, status: str,
               server_round: int) -> tuple[ServerState, str, str | None]:
        """Refuse a non-finite or exploding step: the model stays as it was, the reason is logged.

        The accounting state (``wrapper_state``: a DP accountant) is kept: the round ran.
        """
        problem = step_problem(before.params, after.params, self.scenario.federation.max_update_ratio)
        if problem is None:
            return after, status, None
        self.runlog.log(f"round {server_round}: aggregate rejected: {problem}; model unchanged",
                       "warning")
        return replace(before, round=server_round, wrapper_state=after.wrapper_state), RoundStatus.REJECTED, problem

    def _eval_deadline(self, t0: float) -> float:
        """How long federated evaluation may wait: what is left of the round's deadline, at most ``eval_deadline_s``.

        The round's ``federation.deadline_s`` holds for training and evaluation
        together; evaluation gets at least :data:`EVAL_FLOOR_S` (or the whole
        deadline, if shorter) when training used it up.
        """
        deadline = self.scenario.federation.deadline_s
        left = deadline - (time.monotonic() - t0)
        return min(self.eval_deadline_s, max(left, min(EVAL_FLOOR_S, deadline)))

    def _evaluate_and_record(self, grid: Grid, state: ServerState, outcome: TrainOutcome[Any], nodes: list[int],
                             server_round: int, started: float, t0: float, status: str) -> RoundRecord:
        ev = self.scenario.evaluation
        fed_loss = fed_acc = srv_loss = srv_acc = None
        task_metrics: dict[str, float] = {}  # the task's own server-side scores: server-mae, server-r2, ...
        fed_metrics: dict[str, float] = {}  # the task's own federated scores: fed-mae, fed-r2, ...
        train_loss = outcome.train_loss
        clients = _marked_clients(outcome)  # what a robust rule did to each update
        if server_round % ev.every == 0 or server_round == self.scenario.rounds:
            if ev.federated:
                ok = [n for n in nodes if any(c.client == str(n) and c.outcome == ClientStatus.OK for c in clients)]
                targets = _eval_sample(sorted(grid.get_node_ids()) if ev.clients == "all" else (ok or nodes),
                                       self.scenario, server_round)
                summary = self.evaluate(grid, targets, state.params,
                                             self._train_config(None, server_round), self._eval_deadline(t0),
                                             self.layout)
                fed_loss, fed_acc = summary.loss, summary.accuracy
                fed_metrics = {f"fed-{k}": v for k, v in summary.metrics.items()}
                # federated evaluation's traffic: beside the training traffic that bytes_in / bytes_out hold
                fed_metrics.update({"eval-bytes-in": summary.bytes_in, "eval-bytes-out": summary.bytes_out})
                if summary.dropped:  # the federated score is over fewer clients than were asked
                    fed_metrics["eval-dropped"] = len(summary.dropped)
                train_loss = summary.train_loss if summary.train_loss is not None else train_loss
                clients = _with_refused_evals([_with_eval(c, summary) for c in clients], summary)
            if ev.server and self.server_eval is not None:
                scores = self.server_eval.score(state.params)
                srv_loss, srv_acc, task_metrics = scores["loss"], scores.get("accuracy"), task_round_metrics(scores)
        epsilon = _epsilon(self.strategy, state)
        return RoundRecord(
            round=server_round, started_at=started, duration_s=time.monotonic() - t0, sampled=len(nodes),
            clients=clients, train_loss=train_loss, fed_loss=fed_loss, fed_accuracy=fed_acc,
            server_loss=srv_loss, server_accuracy=srv_acc, bytes_in=outcome.bytes_in,
            bytes_out=outcome.bytes_out, epsilon=epsilon,
            secagg=outcome.secagg, tree=outcome.tree,
            metrics={"status": status, **fed_metrics, **task_metrics, **round_metrics(self.strategy, state)})


def _marked_clients(outcome: TrainOutcome[Any]) -> list[ClientRecord]:
    """Return the round's client records with what a robust rule did to each update in their metrics.

    A robust aggregate state (:class:`core.buffer.Marked`) marks updates by
    arrival index (``{"clipped": 1.0}``, ``{"rejected": 1.0}``,
    ``{"trimmed": f}``); the n-th ``ok`` record is the n-th update folded,
    since a workflow records a client as ``ok`` exactly when its update was
    folded.
    """
    marks = outcome.aggregate.marks if isinstance(outcome.aggregate, Marked) else {}
    if not marks:
        return list(outcome.clients)
    records, folded = [], 0
    for record in outcome.clients:
        if record.outcome == ClientStatus.OK:
            mark = marks.get(folded)
            folded += 1
            if mark:
                record = replace(record, metrics={**(record.metrics or {}), **mark})
        records.append(record)
    return records


def _with_eval(record: ClientRecord, summary: EvalSummary) -> ClientRecord:
    """Return ``record`` with the client's own scores of the global model.

    Its loss and accuracy, and every other metric its task reported as
    ``eval-<name>`` with its test-split size as ``eval-examples`` (the weight
    its scores had in the round's federated means), so a per-client C-index or
    MAE reads back from the store.
    """
    try:
        node = int(record.client)
    except ValueError:
        return record
    result = summary.per_client.get(node)
    if result is None:
        return record
    named = {f"eval-{k}": v for k, v in summary.per_client_metrics.get(node, {}).items()}
    metrics = {**(record.metrics or {}), **named, "eval-examples": result[2]}
    return replace(record, eval_loss=result[0], eval_accuracy=result[1], metrics=metrics)


def _with_refused_evals(records: list[ClientRecord], summary: EvalSummary) -> list[ClientRecord]:
    """Mark the clients whose evaluate reply was refused, at stage ``evaluate``, with the reason.

    A refused reply is ``rejected``; an evaluate task that raised is
    ``failed``; one its device's site policy refused, ``refused``; a client
    that never answered within the deadline is ``dropped`` (its evaluation is
    missing from the round's scores, and the round says so). A client that was asked to evaluate only
    (``evaluation.clients = "all"``) gets a record of its own. A client whose
    training reply was already refused keeps that first reason.
    """
    marks = {str(node): (DROPPED, "no evaluation reply within the round's deadline") for node in summary.dropped}
    marks.update({str(node): (REJECTED, f"eval reply rejected: {why}") for node, why in summary.rejected.items()})
    marks.update({str(node): (FAILED, why) for node, why in summary.failed.items()})
    marks.update({str(node): (REFUSED, why) for node, why in summary.refused.items()})
    marked = [replace(r, outcome=marks[r.client][0], stage="evaluate", reason=marks[r.client][1])
              if r.client in marks and r.outcome == OK else r for r in records]
    known = {r.client for r in records}
    return marked + [ClientRecord(client=c, outcome=outcome, stage="evaluate", reason=why)
                     for c, (outcome, why) in sorted(marks.items()) if c not in known]


def _eval_sample(targets: list[int], scenario: Scenario, server_round: int) -> list[int]:
    """Sample ``[evaluation] fraction`` of ``targets`` (at least ``min_clients``), a pure function of (seed, round)."""
    ev = scenario.evaluation
    if ev.fraction >= 1.0:
        return targets
    k = min(len(targets), max(int(len(targets) * ev.fraction), ev.min_clients))
    picks = np.random.default_rng([scenario.seed, server_round, 0xE7]).choice(len(targets), size=k, replace=False)
    return sorted(targets[i] for i in picks)


def _epsilon(strategy: Strategy[Any], state: ServerState) -> float | None:
    """Return the privacy spent so far, for strategies that account it (finite values only)."""
    value = spent_epsilon(strategy, state)
    return float(value) if value is not None and np.isfinite(value) else None
