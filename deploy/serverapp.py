"""The ServerApp a SuperLink runs: Quorum's round loop, made safe to restart.

The round loop is :func:`aggregator.serverapp.run_federation`, exactly as in
simulation. What a real deployment adds:

* **waiting for the federation**: a run (or a resumed run) starts its first
  round only once the scenario's ``clients`` devices are connected, or
  ``wait-clients-s`` has passed with at least ``min_clients``; sampling is a
  pure function of (seed, round, node ids), so a resumed run that sampled
  from a half-reconnected fleet would diverge from an uninterrupted one;
* **a lease on the run**: an aggregator killed mid-run leaves a ServerApp
  that takes a moment to notice; the restarted one takes the run's lease, and
  the old one can no longer commit a round or change the run's status, so no
  round is ever counted twice;
* **finding its run again**: the Flower run id is recorded in the stored
  run, so a ServerApp that Flower itself restarts for the same Flower run
  resumes the stored run instead of opening a new one.

Node ids are the SuperLink's: it assigns one per registered key and keeps it
in its database (``linkstate.db`` in the aggregator's state folder), so they
are stable across SuperLink restarts and across runs, and a device's sampling
and training seed stay the same as long as its key stays enrolled.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import uuid
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from aggregator.errors import TooFewClients
from aggregator.serverapp import WAIT_CLIENTS_S, run_federation, wait_for_nodes
from core.errors import RunNotFound
from core.records import RoundRecord
from core.status import ENDED, RunStatus
from core.strategy import ServerState
from deploy.errors import DeployError
from learning.errors import TaskError
from learning.record import scenario_record
from learning.task import load_task
from runstore.store import RunStore, default_db_url
from scenarios.errors import ScenarioError
from scenarios.runconfig import scenario_from_run_config
from scenarios.schema import Scenario

__all__ = ["app", "LeasedRunStore", "LeaseLost", "record_failed_start"]

ENGINE = "deployment"

class LeaseLost(DeployError):
    """Another ServerApp took over this run; this one must stop writing."""


class LeasedRunStore(RunStore):
    """A run store whose writes to one run need that run's lease.

    ``take(run_id)`` writes this process's token into the run; commits and
    status changes check it first, so of two ServerApps driving one run only
    the one that took it last can write.
    """

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def take(self, run_id: str) -> None:
        self.update_info(run_id, lease=self.token)

    def _check(self, run_id: str) -> None:
        holder = (self.get_run(run_id).info or {}).get("lease")
        if holder not in (None, self.token):
            raise LeaseLost(f"run {run_id} is now driven by ServerApp {holder}; this one ({self.token}) stops")

    def commit_round(self, run_id: str, record: RoundRecord, state: ServerState) -> None:
        self._check(run_id)
        super().commit_round(run_id, record, state)

    def set_status(self, run_id: str, status: str, error: str | None = None) -> None:
        self._check(run_id)
        super().set_status(run_id, status, error)


def record_failed_start(store: LeasedRunStore, scenario: Scenario, flower_run: int, devices: dict,
                        why: str) -> str:
    """Store a run that never started as ``failed``, with the reason, under its Flower run id."""
    try:  # as every run records its scenario, unless the task is what failed to load
        record = scenario_record(scenario, load_task(scenario))
    except (ScenarioError, TaskError):
        record = scenario.to_dict()
    run_id = store.create_run(name=scenario.name, scenario=record, seed=scenario.seed,
                              strategy=scenario.strategy.name, rounds=scenario.rounds, engine=ENGINE,
                              info={"flower_run_id": flower_run, "devices": devices})
    store.take(run_id)
    store.set_status(run_id, RunStatus.FAILED, f"never started: {why}")
    return run_id


def _find_run(store: RunStore, flower_run_id: int) -> str | None:
    """The unfinished stored run a previous ServerApp opened for this Flower run, if any."""
    for run in store.list_runs():
        info = run.info or {}
        if info.get("flower_run_id") == flower_run_id and run.status not in ENDED:
            return run.id
    return None


def _scenario(config: dict) -> Scenario:
    scenario = scenario_from_run_config(config)
    overrides = json.loads(str(config.get("overrides") or "{}"))
    return scenario.with_overrides(**overrides) if overrides else scenario


def _own_log(state_dir: str, flower_run: int) -> None:
    """Send this process's output to ``logs/serverapp-<run>.log`` (Flower discards it), let
    ``kill -USR1`` dump its stacks there, and leave a pid file the supervisor can check."""
    if not state_dir:
        return
    root = Path(state_dir)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    log = open(root / "logs" / f"serverapp-{flower_run}.log", "ab", buffering=0)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log)
    (root / "serverapps").mkdir(exist_ok=True)
    pidfile = root / "serverapps" / f"{os.getpid()}.json"
    pidfile.write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "flower_run": flower_run}))
    atexit.register(pidfile.unlink, missing_ok=True)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point under a SuperLink (``quorum aggregator run``)."""
    config = dict(context.run_config)
    _own_log(str(config.get("state-dir") or ""), context.run_id)
    scenario = _scenario(config)
    store = LeasedRunStore(str(config.get("db") or os.environ.get("QUORUM_DB") or default_db_url()))
    resume = str(config.get("resume") or "") or _find_run(store, context.run_id)
    if resume:
        try:
            resume = store.get_run(resume).id
        except RunNotFound as exc:  # no such run, or a prefix that several runs share
            raise DeployError(f"cannot resume run {resume!r}: {exc}") from None
        store.take(resume)
    fed = scenario.federation
    devices = json.loads(str(config.get("devices") or "{}"))
    try:
        wait_for_nodes(grid, fed.clients, float(config.get("wait-clients-s", WAIT_CLIENTS_S)), least=fed.min_clients)
    except TooFewClients as exc:
        if not resume:  # a run that never started is still a stored, visible, failed run
            record_failed_start(store, scenario, context.run_id, devices, str(exc))
        raise

    def on_start(run_id: str) -> None:
        store.take(run_id)
        store.update_info(run_id, flower_run_id=context.run_id, devices=devices)

    run_federation(grid, scenario, store, engine=ENGINE, resume_id=resume, on_start=on_start)
