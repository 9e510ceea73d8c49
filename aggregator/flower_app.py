"""A stock Flower app under Quorum's ServerApp: its model, its run-config keys, its log.

An app whose ``pyproject.toml`` points ``serverapp`` at
``aggregator.serverapp:app`` (its ClientApp unchanged) and whose run config
names no Quorum scenario is run by :func:`serve_flower_app`, under ``flwr
run`` (the app's folder is found on ``sys.path``, where Flower put it) and
in-process by ``quorum flower run APP_DIR`` (``runtimes.flower_app``):

- the model is the app's own (``aggregator.app_model``): its ServerApp's
  initial arrays and train config, else the first client reply's arrays;
- its run-config keys become the run's settings, or stop it, by name
  (``scenarios.flower_app``);
- every round, and how the run ended, goes to Flower's log (the ``flwr``
  logger of the ServerApp process, which ``flwr run --stream`` shows); a run
  that ends ``failed`` raises :class:`~aggregator.errors.RunFailed`, so Flower
  records it as failed too. :func:`round_logger` / :func:`log_end` do the same
  for a run of a Quorum scenario.
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid

from aggregator.app_model import AppModel, initial_model
from aggregator.errors import AppModelError, RunFailed
from aggregator.rounds import LoopResult
from core.headline import Headline, format_value, round_scores
from core.outcomes import count, round_line
from core.records import RoundRecord
from core.status import RoundStatus, RunStatus
from core.strategy import ServerState
from learning.record import scenario_record
from runstore.store import RunStore
from scenarios.flower_app import AppKeys, flower_app_scenario, min_available
from scenarios.schema import Scenario

__all__ = ["FlowerApp", "read_app", "find_app", "serve_flower_app", "plan_flower_app", "plan_model", "round_logger",
           "round_text", "log_end", "QUORUM_SERVERAPP", "QUORUM_CLIENTAPP"]

#: What an app's ``[tool.flwr.app.components] serverapp`` says to run under Quorum's ServerApp.
QUORUM_SERVERAPP = "aggregator.serverapp:app"
#: Quorum's own ClientApp: an app that runs it is Quorum's (a scenario's), not a stock Flower app.
QUORUM_CLIENTAPP = "clients.clientapp:app"


@dataclass(frozen=True)
class FlowerApp:
    """A Flower app's folder as its ``pyproject.toml`` describes it."""

    path: Path | None
    name: str = "flower-app"
    clientapp: str = ""
    serverapp: str = ""
    config: dict[str, Any] = field(default_factory=dict)  # [tool.flwr.app.config], as Flower flattens it

    @property
    def own_serverapp(self) -> str | None:
        """The app's own ServerApp, when its file is in the app; ``None`` otherwise.

        Found by ``flwr new``'s layout: ``pkg.client_app:app`` ->
        ``pkg.server_app:app``.
        """
        module = self.clientapp.partition(":")[0]
        if self.path is None or not module.endswith("client_app"):
            return None
        server = module.removesuffix("client_app") + "server_app"
        return f"{server}:app" if (self.path / (server.replace(".", "/") + ".py")).is_file() else None


def read_app(path: Path) -> FlowerApp:
    """Read the app in folder ``path`` (its ``pyproject.toml``).

    Raises
    ------
    AppModelError
        No ``pyproject.toml``, one that is not UTF-8 TOML, one without ``[tool.flwr.app.components] clientapp``,
        or one Flower refuses (a missing field, a run-config value of no Flower type); one line, naming the file.
    """
    file = path / "pyproject.toml"
    project = _toml(file)
    components = _table(project, "tool", "flwr", "app", "components")
    if not components.get("clientapp"):
        raise AppModelError(f"{file} names no [tool.flwr.app.components] clientapp: not a Flower app")
    return FlowerApp(path.resolve(), str(_table(project, "project").get("name") or path.name),
                     str(components["clientapp"]), str(components.get("serverapp", "")), _app_config(path, file))


def _toml(file: Path) -> dict[str, Any]:
    """Return the TOML document in ``file`` (UTF-8, as TOML is); any failure is one line naming the file."""
    try:
        return tomllib.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise AppModelError(f"{file} is not UTF-8 text, as TOML must be: byte 0x{exc.object[exc.start]:02x} at "
                            f"position {exc.start}") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise AppModelError(f"{file} is not a readable pyproject.toml: {exc}") from None


def _table(document: dict[str, Any], *keys: str) -> dict[str, Any]:
    """Return the table at ``keys`` (``{}`` where a key is missing or holds something else than a table)."""
    table: Any = document
    for key in keys:
        table = table.get(key) if isinstance(table, dict) else None
    return table if isinstance(table, dict) else {}


def _app_config(path: Path, file: Path) -> dict[str, Any]:
    """Return the app's ``[tool.flwr.app.config]`` as Flower reads and flattens it (Flower's checks of the file)."""
    from flwr.common.config import get_fused_config_from_dir

    try:
        return dict(get_fused_config_from_dir(path, {}))
    except Exception as exc:  # Flower's reading of a file of the user's: whatever it raises on it
        raise AppModelError(f"{file}: Flower refuses it: {' '.join(str(exc).split())}") from None


def find_app(paths: list[str] | None = None) -> FlowerApp | None:
    """Find the Flower app this process runs under ``flwr run``, or ``None``.

    It is the first folder on ``sys.path`` (Flower puts the app's first) whose
    ``pyproject.toml`` runs Quorum's ServerApp with a ClientApp of its own.
    """
    for entry in sys.path if paths is None else paths:
        folder = Path(entry or ".")
        if not (folder / "pyproject.toml").is_file():
            continue
        try:
            app = read_app(folder)
        except AppModelError:
            continue
        if app.serverapp == QUORUM_SERVERAPP and app.clientapp != QUORUM_CLIENTAPP:
            return app
    return None


def serve_flower_app(grid: Grid, context: Context, store: RunStore, *, app: FlowerApp | None, engine: str,
                     wait_s: float = 60.0, on_round: Callable[[RoundRecord], None] | None = None,
                     on_start: Callable[[str], None] | None = None,
                     log_rounds: bool = False) -> tuple[str, LoopResult]:
    """Run a stock Flower app's federation: its keys, its model, Quorum's round loop.

    Returns the run id and how it ended (the run is stored like any other).
    ``log_rounds``: each round to Flower's log too. When the app's own ServerApp,
    run for the model, exits with its own code, dies or sends no message in time,
    the run is stored ``failed`` with that reason and never starts.

    Raises
    ------
    ScenarioError
        A refused or unusable run-config key (before a run exists).
    AppModelError
        No node connected, or no initial model found (before a run exists).
    RunFailed
        The app's ServerApp failed so while a run was being resumed (that run is left as it was).
    """
    from aggregator.serverapp import run_federation  # serverapp's main calls this module

    scenario, keys = plan_flower_app(grid, context, app, wait_s)
    resume = str(context.run_config.get("resume") or "") or None  # Quorum's key: continue that run of this app
    try:
        scenario, model = plan_model(grid, context, app, scenario, keys)
    except RunFailed as exc:
        if resume is not None:
            raise
        return _never_started(store, scenario, engine, str(exc))
    callbacks = [c for c in (round_logger(scenario.rounds) if log_rounds else None, on_round) if c is not None]

    def each_round(record: RoundRecord) -> None:
        for callback in callbacks:
            callback(record)

    return run_federation(grid, scenario, store, engine=engine, model=model, on_round=each_round, on_start=on_start,
                          resume_id=resume)


def plan_flower_app(grid: Grid, context: Context, app: FlowerApp | None, wait_s: float) -> tuple[Scenario, AppKeys]:
    """Plan the run's settings: from the nodes connected (after waiting for the app's ``min-available-nodes``).

    And from its run-config keys (what became of each is the :class:`~scenarios.flower_app.AppKeys`).
    """
    from aggregator.serverapp import wait_for_nodes  # serverapp's main calls this module

    config = dict(context.run_config)
    nodes = wait_for_nodes(grid, min_available(config), wait_s)
    if nodes == 0:
        raise AppModelError(f"no node connected within {wait_s:g} s")
    return flower_app_scenario(config, clients=nodes, name=app.name if app is not None else "flower-app")


def plan_model(grid: Grid, context: Context, app: FlowerApp | None, scenario: Scenario,
               keys: AppKeys) -> tuple[Scenario, AppModel]:
    """Find the app's own model and ``lr`` (``aggregator.app_model``); write the run's plan to Flower's log.

    Raises
    ------
    AppModelError
        No initial model found.
    RunFailed
        The app's ServerApp exited with its own code, died, or sent no message in time.
    """
    model = initial_model(grid, context, app.own_serverapp if app is not None else None)
    if model.lr is not None:  # what the app's ServerApp sends as "lr": sent as it is
        scenario = replace(scenario, training=replace(scenario.training, lr=model.lr))
    log(INFO, "[quorum] Flower app %s under Quorum's ServerApp: %d nodes, %d rounds; model from %s (%s); %s",
        scenario.name, scenario.federation.clients, scenario.rounds, model.source, model.layout.describe(),
        keys.describe())
    return scenario, model


def _never_started(store: RunStore, scenario: Scenario, engine: str, why: str) -> tuple[str, LoopResult]:
    """Store a run that never started as ``failed``, with the reason; its id and ending."""
    run_id = store.create_run(name=scenario.name, scenario=scenario_record(scenario, None), seed=scenario.seed,
                              strategy=scenario.strategy.name, rounds=scenario.rounds, engine=engine,
                              info={"headline": Headline().to_json()})
    store.set_status(run_id, RunStatus.FAILED, f"never started: {why}")
    return run_id, LoopResult(ServerState(params=np.zeros(0, np.float32)), RunStatus.FAILED, None)


def round_logger(rounds: int) -> Callable[[RoundRecord], None]:
    """Return an ``on_round`` that writes each round to Flower's log.

    A round where a client dropped, failed or was rejected is a WARNING whose
    line names them and why.
    """

    def on_round(record: RoundRecord) -> None:
        tally = count(record.clients)
        level = WARNING if tally.dropped or tally.rejected or tally.failed else INFO
        log(level, "[quorum] %s", round_text(record, rounds))

    return on_round


def round_text(record: RoundRecord, rounds: int) -> str:
    """``round 2/3: accuracy 91.20%, loss 0.3124 (fed), train-loss 0.41, 1.2 s; clients 2/2 answered``."""
    scores = round_scores(record)
    split = next(iter(scores), None)
    shown = [f"{k} {format_value(k, v)}" for k, v in sorted((scores.get(split or "") or {}).items(),
                                                              key=lambda kv: (kv[0] != "accuracy", kv[0]))][:6]
    where = f" ({'server' if split == 'server' else 'fed'})" if shown else ""
    train = f", train-loss {record.train_loss:.4g}" if record.train_loss is not None else ""
    status, reason = (record.metrics or {}).get("status", RoundStatus.OK), (record.metrics or {}).get("reason")
    state = "" if status == RoundStatus.OK else f" [{status}" + (f": {reason}" if reason else "") + "]"
    return (f"round {record.round}/{rounds}: {', '.join(shown) or 'no scores'}{where}{train}, "
            f"{record.duration_s:.1f} s{state}; clients {round_line(record.sampled, count(record.clients))}")


def log_end(store: RunStore, run_id: str, result: LoopResult) -> None:
    """Write how the run ended to Flower's log; a ``failed`` run raises, so Flower records it as failed.

    Raises
    ------
    RunFailed
        The run ended ``failed`` (the message is the stored reason).
    """
    run = store.get_run(run_id)
    reason = f": {run.error}" if run.error else ""
    levels: dict[str, int] = {RunStatus.FINISHED: INFO, RunStatus.STOPPED_BUDGET: INFO, RunStatus.DEGRADED: WARNING}
    level = levels.get(result.status, ERROR)
    log(level, "[quorum] run %s %s after %d rounds%s (store %s)", run_id, result.status, run.rounds_done or 0,
        reason, store.url)
    if result.status == RunStatus.FAILED:
        raise RunFailed(f"run {run_id} failed{reason}")

