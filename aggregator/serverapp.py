"""Quorum's Flower ServerApp, and the one function that runs a federation.

:func:`run_federation` is what every runtime calls: the in-process grid of
``quorum simulate``, Flower's Ray simulation and a real SuperLink all hand it
a ``Grid``. It builds the strategy (wrapped for DP when the scenario asks),
the train workflow (plain or secure aggregation), opens or resumes the run in
the store and drives the :class:`~aggregator.rounds.RoundLoop`.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from sqlalchemy import func, select

from aggregator.app_model import AppModel
from aggregator.errors import ResumeRefused, TooFewClients
from aggregator.evaluation import ServerEvaluator, federated_evaluate
from aggregator.fedbuff import BufferedLoop
from aggregator.flower_app import find_app, log_end, round_logger, serve_flower_app
from aggregator.hierarchy.evaluate import TreeEvaluate
from aggregator.hierarchy.fleet import EdgeFleet, deployed_tree_problem
from aggregator.hierarchy.robust import EdgeRobust
from aggregator.hierarchy.serve import EDGE_CHANNEL, EDGE_IDLE_S, EDGE_NAME, EDGE_RUN, EdgeServer
from aggregator.hierarchy.tree import TreeTrain
from aggregator.resume import check_same_scenario, has_ended, scenario_difference, start_state
from aggregator.rounds import LoopResult, RoundLoop
from aggregator.standardize import standardize_run
from aggregator.strategies import Strategy
from aggregator.strategies.registry import build_base
from aggregator.train import PlainTrain
from core.channel import Channel
from core.errors import RunNotFound
from core.headline import Headline
from core.layouts import ParamLayout
from core.outcomes import refusal_summary, run_problems
from core.records import RoundRecord
from core.status import ENDED, NOT_LEARNED, ClientStatus, RoundStatus, RunStatus
from core.strategy import ServerState, describe, initial_state
from core.train import TrainWorkflow
from core.weighting import WeightPolicy
from learning.errors import TaskError
from learning.models import layout_of
from learning.record import scenario_record
from learning.standardize import Standardization
from learning.task import TaskModel, load_task, task_headline
from privacy.dp.build import make_dp_strategy
from privacy.secagg.train import SecAggTrain
from runstore.runlog import RunLog
from runstore.store import ClientResult, Run, RunStore, default_db_url
from runstore.submissions import attach_run
from runstore.takeover import TakenRunStore
from scenarios.bounds import MAX_WAIT_S
from scenarios.errors import ScenarioError
from scenarios.flower_app import is_flower_app
from scenarios.runconfig import scenario_from_run_config
from scenarios.schema import Scenario, scenario_from_dict

__all__ = ["app", "build_strategy", "build_train", "build_device_train", "run_federation", "fork_run", "RunHandle",
           "final_status"]


def build_strategy(scenario: Scenario) -> Strategy[Any]:
    """Build the scenario's strategy (by name: ``aggregator.strategies.registry``), in DP-FedAvg under ``[dp]``.

    A robust rule under ``[hierarchy]`` runs at each edge, with FedAvg over the edges
    (:class:`aggregator.hierarchy.robust.EdgeRobust`).
    """
    base = build_base(scenario)
    if scenario.hierarchy.enabled and scenario.strategy.robust:  # the rule at each edge, FedAvg over the edges
        return EdgeRobust(base)
    if not scenario.dp.enabled:
        return base
    return make_dp_strategy(base, scenario.dp, clients_per_round=scenario.federation.per_round,
                            population=scenario.federation.clients, rounds=scenario.rounds)


def build_train(scenario: Scenario) -> TrainWorkflow:
    """Plain training, or secure aggregation when ``[secagg]`` is enabled; through edges under ``[hierarchy]``.

    Under ``[hierarchy]`` the workflow above is what each edge runs over its
    own devices (secure aggregation inside each edge's cohort), and the
    aggregator merges the edges' sums (:class:`aggregator.hierarchy.tree.TreeTrain`).
    """
    fed = scenario.federation
    policy = WeightPolicy(fed.weighting, median_cap=fed.median_cap, max_examples=fed.max_examples)
    train = build_device_train(scenario)
    if not scenario.hierarchy.enabled:
        return train
    return TreeTrain(train, scenario.hierarchy.edges, weighting=None if scenario.secagg.enabled else policy,
                     max_update_ratio=fed.max_update_ratio, accumulate=fed.accumulate,
                     secure_across=scenario.secagg if scenario.hierarchy.secure_across_edges else None,
                     unit_weights=scenario.dp.enabled or scenario.strategy.robust)


def build_device_train(scenario: Scenario) -> TrainWorkflow:
    """Return the workflow that trains devices: plain, or secure aggregation when ``[secagg]`` is enabled.

    A flat round's, and what each edge runs over its own devices under ``[hierarchy]``.
    """
    fed = scenario.federation
    if not scenario.secagg.enabled:
        policy = WeightPolicy(fed.weighting, median_cap=fed.median_cap, max_examples=fed.max_examples)
        return PlainTrain(policy, max_update_ratio=fed.max_update_ratio, accumulate=fed.accumulate)
    # DP-FedAvg weighs every client 1: no weight cap above 1 is needed, and a
    # larger one would cost quantisation precision.
    return SecAggTrain(replace(scenario.secagg, max_weight=1.0) if scenario.dp.enabled else scenario.secagg,
                       accumulate=fed.accumulate)


@dataclass(frozen=True)
class RunHandle:
    """Where a run lives: its store and id."""

    store: RunStore
    run_id: str


def _model_factory(scenario: Scenario) -> tuple[Callable[[], TaskModel], Any]:
    """Return the scenario's task: a factory of its model (from the run's seed) and the server's held-out data."""
    task = load_task(scenario)
    test = task.server_data()

    def factory() -> TaskModel:
        return TaskModel.build(task, scenario.seed)

    return factory, test


def _headline(scenario: Scenario) -> dict[str, str]:
    """Return the task's headline metric, as the run records it for every reader (``core.headline``)."""
    return task_headline(load_task(scenario)).to_json()


def open_run(store: RunStore, scenario: Scenario, strategy: Strategy[Any], engine: str,
             resume_id: str | None = None,
             model: AppModel | None = None) -> tuple[str, ServerState, Callable[[], TaskModel] | None, Any]:
    """Create a run (or reopen ``resume_id``); returns (run_id, state, model factory, test set).

    With ``model`` (a Flower app's own, ``aggregator.app_model``) no task is loaded: no factory, no test set.
    """
    factory, test = _model_factory(scenario) if model is None else (None, None)
    if resume_id is not None:
        state = start_state(store, store.get_run(resume_id), strategy)
        store.set_status(resume_id, RunStatus.RUNNING)
        store.log(resume_id, f"resumed after round {state.round if state else 0}")
        if state is not None:
            return resume_id, state, factory, test
    # the trainable tensors only: frozen ones never travel
    initial = factory().get_flat() if factory is not None else model.params  # type: ignore[union-attr]
    info = ({"strategy": describe(strategy), "headline": _headline(scenario)} if model is None else
            {"strategy": describe(strategy), "headline": Headline().to_json(), "model": model.source})
    run_id = resume_id or store.create_run(
        name=scenario.name, scenario=scenario_record(scenario, load_task(scenario) if model is None else None),
        seed=scenario.seed,
        strategy=describe(strategy)["name"], rounds=scenario.rounds, engine=engine,
        num_params=int(initial.size), info=info)
    return run_id, initial_state(strategy, initial), factory, test


def _loop(scenario: Scenario, strategy: Any, train: Any, run: RunLog, evaluator: Any,
          on_round: Callable[[RoundRecord], None] | None, layout: Any, standardization: Any,
          model: AppModel | None) -> RoundLoop | BufferedLoop:
    """Build the loop that drives the run: buffered asynchronous steps (``[async]``) or synchronous rounds."""
    if scenario.asynchronous.enabled:
        fed = scenario.federation
        return BufferedLoop(scenario=scenario, strategy=strategy, runlog=run,
                            server_eval=evaluator, on_round=on_round, layout=layout,
                            weighting=WeightPolicy(fed.weighting, median_cap=fed.median_cap,
                                                   max_examples=fed.max_examples))
    tree = scenario.hierarchy
    return RoundLoop(scenario=scenario, strategy=strategy, train=train, runlog=run,
                     server_eval=evaluator, on_round=on_round, layout=layout, standardization=standardization,
                     app_config=model.train_config if model is not None else {},
                     evaluate=TreeEvaluate(tree.edges) if tree.enabled else federated_evaluate)


def run_federation(grid: Grid, scenario: Scenario, store: RunStore, *, engine: str,
                   resume_id: str | None = None,
                   on_round: Callable[[RoundRecord], None] | None = None,
                   on_start: Callable[[str], None] | None = None,
                   model: AppModel | None = None) -> tuple[str, LoopResult]:
    """Run (or resume) a federation over ``grid``; returns the run id and how it ended.

    ``model``: a Flower app's own model and train config (``aggregator.flower_app``) instead of the
    scenario's task; the scenario then gives only the federation's settings.

    Configuration errors of the strategy or the train workflow surface (as
    :class:`ScenarioError`) before a run row exists; anything that fails once it
    exists marks the run ``failed`` with the message, so no row stays ``running``.
    While it runs, this process holds the run (:class:`~runstore.runlog.RunLog`: it renews the run's lease).

    ``resume_id`` continues that run with its own scenario only (another raises
    :class:`~aggregator.errors.ResumeRefused` and leaves the run as it was); a run
    that already ended is returned as it is, untouched.
    """
    strategy, train = _build(scenario)
    if scenario.asynchronous.enabled and scenario.asynchronous.clock == "virtual" and engine != "inprocess":
        raise ScenarioError(f"{scenario.name}: async.clock = \"virtual\" simulates device speeds on the in-process "
                            f"engine only (engine {engine!r}); set async.clock = \"wall\" to run in real time")
    if resume_id is not None:
        stored = store.get_run(resume_id)
        check_same_scenario(stored, scenario)
        if has_ended(stored):
            state = store.load_state(stored.id) or ServerState(params=np.zeros(0, np.float32))
            return stored.id, LoopResult(state, stored.status, None)
        resume_id = stored.id
    run_id, state, factory, test = open_run(store, scenario, strategy, engine, resume_id, model)
    run = RunLog(store, run_id).hold()  # this process drives the run: it renews the run's lease
    try:
        if on_start is not None:
            on_start(run_id)
        if model is None:
            assert factory is not None  # open_run builds the task's model factory whenever there is no app model
            evaluator, layout, standardization = _prepare(grid, scenario, store, run_id, factory, test)
        else:
            evaluator, layout, standardization = None, model.layout, None
        loop = _loop(scenario, strategy, train, run, evaluator, on_round, layout, standardization, model)
        result = LoopResult(*loop.run(grid, state)) if isinstance(loop, BufferedLoop) else loop.run(grid, state)
    except BaseException as exc:
        run.end(RunStatus.INTERRUPTED if isinstance(exc, KeyboardInterrupt) else RunStatus.FAILED,
                error=f"{type(exc).__name__}: {exc}")
        raise
    try:
        status, error = final_status(store, run_id, result.status)
        if isinstance(loop, BufferedLoop) and result.status == RunStatus.FAILED:
            error = loop.failure
        run.end(status, error=error)
    finally:
        run.release()
    return run_id, replace(result, status=status)


def _build(scenario: Scenario) -> tuple[Strategy[Any], TrainWorkflow]:
    try:
        return build_strategy(scenario), build_train(scenario)
    except ValueError as exc:  # SecAggConfigError, DPConfigError: a setting the schema let through
        raise ScenarioError(f"{scenario.name}: {exc}") from None


def fork_run(store: RunStore, parent_id: str, server_round: int | None, scenario: Scenario,
             engine: str = "inprocess") -> str:
    """Create a new run of ``scenario`` that starts from a round of run ``parent_id``; return its id.

    The round is ``server_round`` (default: the last); this is ``quorum resume
    --from``. The parent is recorded in ``info["parent"]``.

    The new run's rounds go on from ``server_round + 1`` to ``scenario.rounds``;
    it keeps the parent's optimiser and privacy state when the strategy is the
    same. Run it with ``run_federation(..., resume_id=<the new id>)``.

    Raises
    ------
    ResumeRefused
        The parent has no such round, the scenario has no round after it, or
        the scenario's model does not fit the checkpoint; no run is created.
    """
    parent = store.get_run(parent_id)
    server_round = _start_round(store, parent.id, server_round, scenario)
    strategy, _ = _build(scenario)  # a bad setting fails here, before a run exists
    size = _fitting_size(store, parent, server_round, scenario)
    return store.create_run(name=scenario.name, scenario=scenario_record(scenario, load_task(scenario)),
                            seed=scenario.seed, strategy=describe(strategy)["name"], rounds=scenario.rounds,
                            engine=engine, num_params=size, rounds_done=server_round,
                            info={"strategy": describe(strategy), "headline": _headline(scenario),
                                  "parent": {"run": parent.id, "round": server_round}})


def _start_round(store: RunStore, parent_id: str, server_round: int | None, scenario: Scenario) -> int:
    """Return the committed round of ``parent_id`` a new run starts from (default: its last)."""
    committed = [r.round for r in store.rounds(parent_id)]
    start = committed[-1] if server_round is None and committed else server_round
    if start is None or start not in committed:
        held = f"rounds {committed[0]} to {committed[-1]}" if committed else "no round"
        raise ResumeRefused(f"run {parent_id} has no round {start} to start from (it holds {held})")
    if scenario.rounds <= start:
        raise ResumeRefused(f"{scenario.name}: rounds = {scenario.rounds} leaves none to run after round "
                            f"{start}; set rounds above {start}")
    return start


def _fitting_size(store: RunStore, parent: Run, server_round: int, scenario: Scenario) -> int:
    """Return the scenario's model size, which must be that of the parent's checkpoint."""
    state = store.load_state(parent.id, server_round)
    size = int(TaskModel.build(load_task(scenario), scenario.seed).get_flat().size)
    if state is None or state.params.size != size:
        stored = scenario_from_dict(parent.scenario, source=f"run {parent.id}").to_dict()  # a record, read back
        what = scenario_difference({k: v for k, v in stored.items() if k in ("model", "task")},
                                   {k: v for k, v in scenario.to_dict().items() if k in ("model", "task")})
        raise ResumeRefused(f"the scenario's model does not fit round {server_round} of run {parent.id} "
                            f"({state.params.size if state else 0:,} parameters there, {size:,} here"
                            + (f"; {what})" if what else ")"))
    return size


def _prepare(grid: Grid, scenario: Scenario, store: RunStore, run_id: str, factory: Callable[[], TaskModel],
             test: Any) -> tuple[ServerEvaluator | None, ParamLayout, Standardization | None]:
    """Prepare what the loop needs besides the state.

    Returns the server's evaluator (on its held-out set, standardised when
    ``[data] standardize`` asks: the statistics passes run here), the model's
    layout, and the standardisation.
    """
    standardization, test = standardize_run(grid, scenario, store, run_id, test)
    evaluator = ServerEvaluator(factory, test) if test is not None and scenario.evaluation.server else None
    model = factory()  # its tensor names and shapes: the global model travels as its state dict
    return evaluator, layout_of(model.model, model.names), standardization


def final_status(store: RunStore, run_id: str, loop_status: str) -> tuple[str, str | None]:
    """How a run that ran to its end really ended: ``finished``, ``degraded`` or ``failed``.

    ``failed`` when no committed round took a client update into the model
    (all skipped, rejected or empty; the sites that refused under their own
    policy are named); ``degraded``, with the reasons, when some round did
    not, when a site's policy refused a round ("1 of 3 sites refused: secure
    aggregation required (dev0)"), when a client failed or was rejected in
    some round, or when a sampled client never contributed (unless the
    scenario injects dropouts);
    ``finished`` otherwise. Other endings (a spent privacy budget) are kept as
    the loop reported them.
    """
    if loop_status != RunStatus.FINISHED:
        return loop_status, None
    statuses = [(r.round, (r.metrics or {}).get("status", RoundStatus.OK), (r.metrics or {}).get("reason"))
                for r in store.rounds(run_id)]
    idle = [(n, status, reason) for n, status, reason in statuses if status in NOT_LEARNED]
    run = store.get_run(run_id)
    names = {str(k): str(v) for k, v in ((run.info or {}).get("devices") or {}).items()}
    # four columns, not a row object per client and round (10,000 x 100 of them), and only of the clients that
    # were ever anything but ok: a client ok in every round degrades nothing (100,000 of them are 100,000 rows)
    troubled = select(ClientResult.client).where(ClientResult.run_id == run_id,
                                                  ClientResult.outcome != ClientStatus.OK).distinct()
    with store.session() as s:
        results = s.execute(select(ClientResult.client, ClientResult.outcome, ClientResult.reason,
                                   ClientResult.round).where(ClientResult.run_id == run_id,
                                                             ClientResult.client.in_(troubled))).all()
        sites = s.scalar(select(func.count(ClientResult.client.distinct())).where(ClientResult.run_id == run_id))
    problems = []
    if idle:
        last, status, reason = idle[-1]
        why = f"round {last} {status}" + (f": {reason}" if reason else "")
        if len(idle) == len(statuses):
            refused = refusal_summary(results, names, sites_total=sites)  # the cause, when sites' policies refused
            return RunStatus.FAILED, (f"no round changed the model: all {len(statuses)} rounds skipped or rejected "
                                      f"({why})" + (f"; {refused}" if refused else ""))
        problems.append(f"{len(idle)} of {len(statuses)} rounds skipped or rejected ({why})")
    problems += run_problems(results, names, drops_expected=_injects_drops(run.scenario), sites_total=sites)
    return (RunStatus.DEGRADED, "; ".join(problems)) if problems else (RunStatus.FINISHED, None)


def _injects_drops(scenario: dict[str, Any] | None) -> bool:
    """Whether a stored scenario makes clients miss rounds on purpose (``[faults]`` dropouts, stragglers, edges)."""
    faults = (scenario or {}).get("faults") or {}
    dropouts = faults.get("dropouts") or {}
    return any(v > 0 for v in dropouts.values()) or any((faults.get(k) or 0) > 0 for k in ("stragglers", "edges"))


#: How long a run waits for its clients before round 1 when the run config does not say (``wait-clients-s``).
WAIT_CLIENTS_S = 60.0


def wait_for_nodes(grid: Grid, want: int, timeout_s: float, least: int = 0, poll_s: float = 0.2) -> int:
    """Wait until ``want`` nodes are connected, or ``timeout_s`` passed with at least ``least``; returns how many.

    The one wait of every ServerApp (a simulation's, a Flower app's, a deployment's). With ``least = 0`` it
    returns at ``timeout_s`` whatever connected (the run then samples what is there).

    Raises
    ------
    TooFewClients
        Fewer than ``least`` connected by ``timeout_s`` and a grace of as long again (at least 60 s).
    """
    deadline = time.monotonic() + timeout_s
    grace = deadline + max(timeout_s, 60.0)
    while True:
        count = len(list(grid.get_node_ids()))
        now = time.monotonic()
        if count >= want or (now >= deadline and count >= least):
            return count
        if now >= grace:
            raise TooFewClients(f"only {count} of the {least} clients the scenario needs connected "
                                f"within {timeout_s + max(timeout_s, 60.0):.0f} s")
        time.sleep(poll_s)


#: The engine name of a run under ``quorum aggregator run`` (deploy/): a supervised SuperLink of real devices.
DEPLOYMENT = "deployment"


def record_failed_start(store: TakenRunStore, scenario: Scenario, flower_run: int, devices: dict[str, Any],
                        why: str, recorded: dict[str, Any] | None = None) -> str:
    """Store a run that never started as ``failed``, with the reason, under its Flower run id."""
    try:  # as every run records its scenario, unless the task is what failed to load
        record = scenario_record(scenario, load_task(scenario))
    except (ScenarioError, TaskError):
        record = scenario.to_dict()
    run_id = store.create_run(name=scenario.name, scenario=record, seed=scenario.seed,
                              strategy=scenario.strategy.name, rounds=scenario.rounds, engine=DEPLOYMENT,
                              info={"flower_run_id": flower_run, "devices": devices, **(recorded or {})})
    store.take(run_id)
    store.set_status(run_id, RunStatus.FAILED, f"never started: {why}")
    return run_id


def _find_run(store: RunStore, flower_run_id: int) -> str | None:
    """Return the unfinished stored run a previous ServerApp opened for this Flower run, if any."""
    for run in store.list_runs():
        info = run.info or {}
        if info.get("flower_run_id") == flower_run_id and run.status not in ENDED:
            return run.id
    return None


def _own_log(state_dir: str, flower_run: int) -> None:
    """Send this process's output to ``logs/serverapp-<run>.log`` (Flower discards it).

    Also let ``kill -USR1`` dump its stacks there, and leave a pid file the
    supervisor can check.
    """
    if not state_dir:
        return
    root = Path(state_dir)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    log = open(root / "logs" / f"serverapp-{flower_run}.log", "ab", buffering=0)  # noqa: SIM115 - the process's
    os.dup2(log.fileno(), 1)                                                        # own stdout/stderr, to its end
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log)
    (root / "serverapps").mkdir(exist_ok=True)
    pidfile = root / "serverapps" / f"{os.getpid()}.json"
    pidfile.write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "flower_run": flower_run}))
    atexit.register(pidfile.unlink, missing_ok=True)


def _deployed_resume(store: TakenRunStore, config: dict[str, Any], flower_run: int) -> str | None:
    """Return the run a deployment's ServerApp drives on: the one asked for, else the one Flower restarted it for."""
    resume = str(config.get("resume") or "") or _find_run(store, flower_run)
    if not resume:
        return None
    try:
        resume = store.get_run(resume).id
    except RunNotFound as exc:  # no such run, or a prefix that several runs share
        raise ScenarioError(f"cannot resume run {resume!r}: {exc}") from None
    store.take(resume)
    return resume


def _deployed_start(grid: Grid, store: TakenRunStore, scenario: Scenario, config: dict[str, Any], flower_run: int,
                    wait_s: float) -> tuple[str | None, Callable[[str], None]]:
    """Take the run to resume (if any), wait for ``min_clients`` devices; the run to resume and the ``on_start``.

    ``on_start`` takes the run this ServerApp opens and records its Flower run and devices' names.

    Raises
    ------
    TooFewClients
        Too few devices within ``wait_s``; a new run is stored ``failed`` with the reason first.
    """
    devices = json.loads(str(config.get("devices") or "{}"))
    federation = str(config.get("federation") or "")  # whose standby may resume it (deploy.supervisor)
    orgs = json.loads(str(config.get("orgs") or "{}"))  # device name -> its organisation (dashboard.access)
    recorded = {**({"federation": federation} if federation else {}), **({"orgs": orgs} if orgs else {}),
                **_submitted(config)}
    resume = _deployed_resume(store, config, flower_run)
    fed = scenario.federation
    try:
        wait_for_nodes(grid, fed.clients, wait_s, least=fed.min_clients)
    except TooFewClients as exc:
        if not resume:  # a run that never started is still a stored, visible, failed run
            record_failed_start(store, scenario, flower_run, devices, str(exc), recorded)
        raise

    def on_start(run_id: str) -> None:
        store.take(run_id)
        named = grid.device_names() if isinstance(grid, EdgeFleet) else devices  # under edges: edge/device
        store.update_info(run_id, flower_run_id=flower_run, devices=named, **recorded)
        if recorded.get("submission"):  # a remote submission learns its stored run (GET /api/submissions/ID)
            attach_run(store, int(recorded["submission"]), run_id)

    return resume, on_start


def _submitted(config: dict[str, Any]) -> dict[str, Any]:
    """Who submitted the run remotely (``deploy.submissions``): the lead that may stop it and download its model."""
    by = str(config.get("submitted-by") or "")
    if not by:
        return {}
    return {"submitted_by": by, "submitted_org": str(config.get("submitted-org") or ""),
            "submission": int(config.get("submission") or 0)}


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the entry point under ``flwr run``: a Quorum scenario's run, or a stock Flower app's.

    A stock Flower app's (``aggregator.flower_app``) when the run config has no
    scenario. Every round and the run's ending go to Flower's log; a failed run
    raises :class:`~aggregator.errors.RunFailed`.

    One ServerApp for Flower's Ray simulation, a SuperLink of the user's, and a deployment
    (``engine = "deployment"``, what ``quorum aggregator run`` submits). A deployment differs in four options:

    * its output goes to ``<state-dir>/logs/serverapp-<run>.log`` (Flower discards it);
    * it takes the run (:class:`~runstore.takeover.TakenRunStore`), so of an old ServerApp and the one a
      restarted aggregator starts for the same run, only the new one writes; and a ServerApp Flower restarts
      for the same Flower run finds its stored run again (``flower_run_id``) and resumes it;
    * its first round waits for ``min_clients`` devices (sampling is a pure function of seed, round and node
      ids: a resumed run that sampled from a half-reconnected fleet would diverge), and a run that never
      started is stored ``failed`` with the reason;
    * the stored run names its devices (``devices``: node id to name).
    """
    config = dict(context.run_config)
    if config.get(EDGE_CHANNEL):  # an edge aggregator's run on its own SuperLink: the aggregator's rounds
        _serve_edge(grid, context, config)
        return
    engine, wait_s = str(config.get("engine", "flower")), _wait_seconds(config)
    deployed = engine == DEPLOYMENT
    if deployed:
        _own_log(str(config.get("state-dir") or ""), context.run_id)
    url = str(config.get("db") or os.environ.get("QUORUM_DB") or default_db_url())
    store = TakenRunStore(url) if deployed else RunStore(url)
    if is_flower_app(config):
        run_id, result = serve_flower_app(grid, context, store, app=find_app(), engine=engine, wait_s=wait_s,
                                          log_rounds=True)
        log_end(store, run_id, result)
        return
    scenario = scenario_from_run_config(config)
    overrides = json.loads(str(config.get("overrides") or "{}"))
    if overrides:
        scenario = scenario.with_overrides(**overrides)
    on_start: Callable[[str], None] | None = None
    if deployed and scenario.hierarchy.enabled:  # the SuperLink's nodes are edge aggregators: sample their devices
        try:
            grid = _fleet(grid, scenario, config)
        except ScenarioError as exc:  # a run that never started is still a stored, visible, failed run
            if isinstance(store, TakenRunStore):
                record_failed_start(store, scenario, context.run_id, {}, str(exc))
            raise
    if isinstance(store, TakenRunStore):
        resume, on_start = _deployed_start(grid, store, scenario, config, context.run_id, wait_s)
    else:
        resume = str(config.get("resume") or "") or None
        wait_for_nodes(grid, scenario.federation.clients, wait_s)  # least 0: the round loop reports a shortfall
    run_id, result = run_federation(grid, scenario, store, engine=engine, resume_id=resume,
                                    on_round=round_logger(scenario.rounds), on_start=on_start)
    log_end(store, run_id, result)


def _fleet(grid: Grid, scenario: Scenario, config: dict[str, Any] | None = None) -> EdgeFleet:
    """Return the deployment's grid seen through its edge aggregators (``aggregator.hierarchy.fleet``).

    Raises
    ------
    ScenarioError
        A setting a deployed tree cannot run, naming it (:func:`aggregator.hierarchy.fleet.deployed_tree_problem`).
    """
    problem = deployed_tree_problem(scenario)
    if problem is not None:
        raise ScenarioError(problem)
    enrolled = json.loads(str((config or {}).get("devices") or "{}"))  # the edges, as enrolled here
    return EdgeFleet(grid, enrolled={int(k): str(v) for k, v in enrolled.items()})


def _serve_edge(grid: Grid, context: Context, config: dict[str, Any]) -> None:
    """Serve the aggregator's run as an edge aggregator, over this SuperLink's devices, until it goes quiet.

    The run config is the aggregator's (its scenario) plus the edge's own keys
    (:mod:`aggregator.hierarchy.serve`): the hand-off folder, the edge's name, the
    aggregator's run it answers for, how long it waits idle, its devices' names.
    """
    _own_log(str(config.get("state-dir") or ""), context.run_id)
    scenario = scenario_from_run_config(config)
    overrides = json.loads(str(config.get("overrides") or "{}"))
    if overrides:
        scenario = scenario.with_overrides(**overrides)
    fed = scenario.federation
    model = TaskModel.build(load_task(scenario), scenario.seed)
    channel = Channel(Path(str(config[EDGE_CHANNEL])))
    server = EdgeServer(grid, channel, run=int(config[EDGE_RUN]),
                        name=str(config.get(EDGE_NAME) or "edge"), train=build_device_train(scenario),
                        strategy=build_strategy(scenario), deadline_s=fed.deadline_s,
                        max_update_bytes=int(fed.max_update_mb * 2**20), layout=layout_of(model.model, model.names),
                        names=channel.device_names)  # read on every query: devices enroll and move
    idle_s = EDGE_IDLE_S
    print(f"edge {server.name}: serving the aggregator's run {server.run} (idle stop after {idle_s:g} s)", flush=True)
    served = server.serve(idle_s)
    print(f"edge {server.name}: answered {served} messages; idle for {idle_s:g} s, stopping", flush=True)


def _wait_seconds(config: dict[str, Any]) -> float:
    """Return the run config's ``wait-clients-s``: seconds in [0, a week] (default :data:`WAIT_CLIENTS_S`).

    Raises
    ------
    ScenarioError
        Anything else (NaN, infinite, negative, not a number), naming the key and the value.
    """
    value = config.get("wait-clients-s", WAIT_CLIENTS_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_WAIT_S:
        raise ScenarioError(f"run config wait-clients-s = {value!r}: must be seconds in [0, {MAX_WAIT_S:,.0f}]")
    return float(value)
