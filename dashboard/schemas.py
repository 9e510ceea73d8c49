"""Response models of the JSON API: they document ``/openapi.json``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

__all__ = ["RunOut", "RunDetailOut", "RoundOut", "ClientResultOut", "ClientSummaryOut",
           "RecentOut", "EventOut", "RunLiveOut", "MetricOut"]


class MetricOut(BaseModel):
    """The task's headline metric (the task's ``headline_metric``; ``accuracy`` up when it declares none)."""

    name: str = Field(description="The metric's name as the task's evaluate returns it: accuracy, c_index, mae, ...")
    direction: str = Field(description="up (higher is better) or down (lower is better).")


class RunOut(BaseModel):
    """A run: its scenario, status, progress and headline figures."""

    id: str
    name: str = Field(description="The scenario's name.")
    status: str = Field(description="running | finished | degraded | failed | stopped_budget | interrupted "
                                    "(a running run whose process stopped renewing its lease reads interrupted)")
    strategy: str
    engine: str
    seed: int
    rounds_total: int
    rounds_done: int
    num_params: int
    best_accuracy: float | None = Field(description="Best server (else federated) accuracy of any round.")
    last_accuracy: float | None
    epsilon: float | None = Field(description="Privacy budget spent so far; null without DP.")
    bytes_in: int
    bytes_out: int
    started_at: float = Field(description="Unix time.")
    updated_at: float
    finished_at: float | None
    duration_s: float
    error: str | None
    last_seen: float | None = Field(None, description="Unix time the run's process last renewed its lease "
                                                      "(when an interrupted run was last seen alive).")
    metric: MetricOut = Field(description="The task's headline metric: what best_metric and last_metric are.")
    best_metric: float | None = Field(description="Best value of the headline metric over the rounds (the "
                                                  "highest or the lowest, by its direction; server, else federated).")
    last_metric: float | None = Field(description="The headline metric after the last committed round.")


class RunDetailOut(RunOut):
    """A run with the scenario it ran and the facts it recorded about itself (``info``)."""

    scenario: dict[str, Any] = Field(description="The scenario as submitted.")
    info: dict[str, Any]


class RoundOut(BaseModel):
    """One committed round of a run: its clients, losses, scores, traffic and privacy spend."""

    round: int
    started_at: float
    duration_s: float
    sampled: int
    answered: int
    dropped: int
    rejected: int = Field(description="Clients whose reply was refused (with the reason).")
    failed: int = Field(0, description="Clients whose task raised (with the error).")
    refused: int = Field(0, description="Clients whose site policy refused the round (with the rule).")
    train_loss: float | None
    fed_loss: float | None
    fed_accuracy: float | None
    server_loss: float | None
    server_accuracy: float | None
    accuracy: float | None = Field(description="server_accuracy, else fed_accuracy.")
    bytes_in: int
    bytes_out: int
    epsilon: float | None = Field(description="Cumulative epsilon after this round; null without DP.")
    secagg: dict[str, Any] | None = Field(description="Secure aggregation stage record; null without it.")
    tree: dict[str, Any] | None = Field(
        None, description="Edge aggregators ([hierarchy]): `edges`, one row per edge with `edge`, its devices' "
                          "outcomes (`sampled`, `answered`, `dropped`, `rejected`, `failed`, `refused`), `seconds` "
                          "(its sub-round), `bytes_down` (its instruction), `bytes_up` (its partial sum), "
                          "`bytes_devices` (what its devices sent it) and `problem` (why its devices were lost); "
                          "`seconds` and `bytes_devices` over all edges; `secure_across_edges` when the edges' sums "
                          "were summed securely (`edges`, `survivors`, `error_bound`, or `aborted` / `refused` with "
                          "the reason). As recorded (a key may be missing; numbers that are not finite read null). "
                          "Null for a flat round.")
    metrics: dict[str, Any]
    metric: float | None = Field(description="The run's headline metric this round: the server's score, else the "
                                             "federated one.")
    scores: dict[str, dict[str, float]] = Field(description="Every score the task returned this round, by split "
                                                            "(server: the held-out set; federated: the weighted "
                                                            "mean over the clients' test splits), in its own names.")


class ClientResultOut(BaseModel):
    """One client's part in one round: its outcome, figures and traffic."""

    run_id: str
    round: int
    client: str
    outcome: str = Field(description="ok | dropped | rejected | failed | late (error: failed, in older stores)")
    stage: str | None
    reason: str | None
    description: str = Field(description="The outcome in words, e.g. 'dropped at train'.")
    num_examples: int
    train_loss: float | None
    eval_loss: float | None
    eval_accuracy: float | None
    duration_s: float | None
    bytes_in: int = Field(description="The client's replies this round, as serialised on Flower's wire.")
    bytes_out: int = Field(description="The instructions sent to the client this round, as on the wire.")
    metrics: dict[str, Any] = Field(description="The client's figures: train-<name> from training, eval-<name> "
                                                "from its own evaluation (eval-examples: its test split's size).")
    eval_metrics: dict[str, float] = Field(description="The client's own scores of the global model on its test "
                                                       "split, in the task's names (loss, accuracy, c_index, ...).")
    finished_at: float


class RecentOut(BaseModel):
    """One recent participation of a client: the run, the round and its outcome."""

    run_id: str
    round: int
    outcome: str
    description: str


class ClientSummaryOut(BaseModel):
    """A client's participation summed over runs, with its most recent rounds."""

    client: str
    rounds: int = Field(description="Rounds the client was sampled in.")
    ok: int
    dropped: int = Field(description="Dropped or late.")
    rejected: int = Field(description="Replies refused.")
    failed: int = Field(0, description="Tasks that raised.")
    runs: int
    examples: int
    last_seen: float
    last_run: str | None
    last_round: int | None
    recent: list[RecentOut] = Field(description="Newest participations first (at most 30).")


class EventOut(BaseModel):
    """One line of a run's log: Unix time, level and message."""

    ts: float
    level: str
    message: str


class RunLiveOut(BaseModel):
    """The payload of a ``run`` event on the live streams."""

    run: RunOut
    display: dict[str, str]
