"""Rank 0's side of the run store: data-parallel runs are runs like any other.

A data-parallel run is stored with ``engine = "parallel"``; each round is
committed (checkpoint + metrics + one client row per client or rank) exactly
as the federated round loop commits its rounds, so the dashboard, ``quorum
runs`` and ``quorum report`` show it, and a restarted job resumes from the
last committed round. Rank 0 renews the run's lease while it writes, so a job
killed outright reads ``interrupted`` like any other run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.records import ClientRecord, RoundRecord
from core.status import ClientStatus, RunStatus
from core.strategy import ServerState
from core.strategy import epsilon as spent_epsilon
from learning.record import scenario_record
from learning.task import load_task
from runstore.runlog import RunLog
from runstore.store import RunStore
from runtimes.parallel.job import COLUMNS, Job, RoundResult
from runtimes.parallel.mode import Mode
from scenarios.schema import Scenario

__all__ = ["ENGINE", "create_run", "run_info", "strategy_label", "open_run_log", "round_record"]

ENGINE = "parallel"
_C = {name: i for i, name in enumerate(COLUMNS)}


def run_info(mode: Mode, world: int, local_steps: int, bucket_mb: float, timeout_s: float) -> dict[str, Any]:
    """Return what is recorded about the job with the run (its ``info``)."""
    return {"mode": mode.value, "world": world, "local_steps": local_steps, "backend": "gloo",
            "bucket_mb": bucket_mb, "timeout_s": timeout_s}


def strategy_label(scenario: Scenario, mode: Mode) -> str:
    """Return the run's strategy column: the server optimiser, or plain SGD in synchronous mode."""
    return "sync-sgd" if mode is Mode.SYNC else scenario.strategy.name


def create_run(store: RunStore, scenario: Scenario, mode: Mode, num_params: int, info: dict[str, Any]) -> str:
    """Create the run row (status ``running``) and return its id."""
    return store.create_run(name=scenario.name, scenario=scenario_record(scenario, load_task(scenario)),
                            seed=scenario.seed, strategy=strategy_label(scenario, mode), rounds=scenario.rounds,
                            engine=ENGINE, num_params=num_params, info=info)


def open_run_log(store: RunStore, run_id: str) -> tuple[RunLog, ServerState | None]:
    """Hold run ``run_id`` (new or resumed) for rank 0: mark it running; return its log and the resumed state.

    Only rank 0 writes the run; the state is the last committed round's, or ``None`` for a new run.
    """
    resumed = store.load_state(run_id)
    store.set_status(run_id, RunStatus.RUNNING)
    run = RunLog(store, run_id).hold()
    if resumed is not None:
        run.log(f"parallel job resumed after round {resumed.round}")
    return run, resumed


def round_record(job: Job, result: RoundResult, server_round: int, started: float, duration_s: float,
                 server: tuple[float, float | None] | None) -> RoundRecord:
    """Build the round as the run store keeps it, from the all-reduced per-client table."""
    table, labels = result.table, job.row_labels()
    present = np.flatnonzero(table[:, _C["present"]] > 0)
    clients = [_client(labels[i], table[i]) for i in present]
    examples, evaluated = table[:, _C["examples"]].sum(), table[:, _C["eval_n"]].sum()
    train_loss = _ratio(table[:, _C["train_eval_loss_sum"]].sum(), table[:, _C["train_eval_n"]].sum())
    if train_loss is None:  # no federated evaluation this round: the clients' own training losses
        train_loss = _ratio(table[:, _C["loss_sum"]].sum(), examples)
    total_bytes = result.bytes_sent * job.comm.world
    return RoundRecord(
        round=server_round, started_at=started, duration_s=duration_s, sampled=len(present), clients=clients,
        train_loss=train_loss,
        fed_loss=_ratio(table[:, _C["eval_loss_sum"]].sum(), evaluated),
        fed_accuracy=_ratio(table[:, _C["eval_correct"]].sum(), evaluated),
        server_loss=server[0] if server else None, server_accuracy=server[1] if server else None,
        bytes_in=total_bytes, bytes_out=total_bytes, epsilon=_epsilon(job, result.state),
        metrics={"status": result.status, "mode": job.spec.mode.value, "world": job.comm.world,
                 "sync_steps": result.steps, "collective_bytes_per_rank": result.bytes_sent})


def _epsilon(job: Job, state: ServerState) -> float | None:
    """Return the privacy spent so far, for strategies that account it (as the round loop records it).

    None in sync mode, or when the strategy accounts none or the value is not finite.
    """
    value = spent_epsilon(job.strategy, state)
    if value is None or job.spec.mode is Mode.SYNC:
        return None
    return float(value) if np.isfinite(value) else None


def _client(label: str, row: np.ndarray) -> ClientRecord:
    return ClientRecord(client=label, outcome=ClientStatus.OK, num_examples=int(row[_C["examples"]]),
                        train_loss=_ratio(row[_C["loss_sum"]], row[_C["examples"]]),
                        eval_loss=_ratio(row[_C["eval_loss_sum"]], row[_C["eval_n"]]),
                        eval_accuracy=_ratio(row[_C["eval_correct"]], row[_C["eval_n"]]),
                        duration_s=float(row[_C["duration_s"]]))


def _ratio(num: float, den: float) -> float | None:
    return float(num / den) if den > 0 else None
