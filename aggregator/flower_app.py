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

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid

from aggregator.app_model import AppModel, initial_model
from aggregator.errors import AppModelError, RunFailed
from aggregator.rounds import LoopResult
from core.headline import format_value, round_scores
from core.outcomes import count, round_line
from core.records import RoundRecord
from core.status import RoundStatus, RunStatus
from runstore.store import RunStore
from scenarios.flower_app import flower_app_scenario, min_available
from scenarios.schema import Scenario

__all__ = ["FlowerApp", "read_app", "find_app", "serve_flower_app", "plan_flower_app", "round_logger", "round_text",
           "log_end", "QUORUM_SERVERAPP", "QUORUM_CLIENTAPP"]

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
        No ``pyproject.toml``, or one without ``[tool.flwr.app.components] clientapp``.
    """
    from flwr.common.config import get_fused_config_from_dir  # Flower's own reading of [tool.flwr.app.config]

    file = path / "pyproject.toml"
    try:
        project = tomllib.loads(file.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise AppModelError(f"{file} is not a readable pyproject.toml: {exc}") from None
    components = project.get("tool", {}).get("flwr", {}).get("app", {}).get("components", {})
    if not components.get("clientapp"):
        raise AppModelError(f"{file} names no [tool.flwr.app.components] clientapp: not a Flower app")
    return FlowerApp(path.resolve(), str(project.get("project", {}).get("name") or path.name),
                     str(components["clientapp"]), str(components.get("serverapp", "")),
                     dict(get_fused_config_from_dir(path, {})))


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
    ``log_rounds``: each round to Flower's log too.

    Raises
    ------
    ScenarioError
        A refused or unusable run-config key (before a run exists).
    AppModelError
        No node connected, or no initial model found (before a run exists).
    """
    from aggregator.serverapp import run_federation  # serverapp's main calls this module

    scenario, model = plan_flower_app(grid, context, app, wait_s)
    callbacks = [c for c in (round_logger(scenario.rounds) if log_rounds else None, on_round) if c is not None]

    def each_round(record: RoundRecord) -> None:
        for callback in callbacks:
            callback(record)

    resume = str(context.run_config.get("resume") or "") or None  # Quorum's key: continue that run of this app
    return run_federation(grid, scenario, store, engine=engine, model=model, on_round=each_round, on_start=on_start,
                          resume_id=resume)


def plan_flower_app(grid: Grid, context: Context, app: FlowerApp | None, wait_s: float) -> tuple[Scenario, AppModel]:
    """Plan the run's settings and model, and write them to Flower's log.

    From the nodes connected (after waiting for the app's
    ``min-available-nodes``), its run-config keys, its own model and ``lr``.
    """
    from aggregator.serverapp import wait_for_nodes  # serverapp's main calls this module

    config = dict(context.run_config)
    nodes = wait_for_nodes(grid, min_available(config), wait_s)
    if nodes == 0:
        raise AppModelError(f"no node connected within {wait_s:g} s")
    name = app.name if app is not None else "flower-app"
    scenario, keys = flower_app_scenario(config, clients=nodes, name=name)
    model = initial_model(grid, context, app.own_serverapp if app is not None else None)
    if model.lr is not None:  # what the app's ServerApp sends as "lr": sent as it is
        scenario = replace(scenario, training=replace(scenario.training, lr=model.lr))
    log(INFO, "[quorum] Flower app %s under Quorum's ServerApp: %d nodes, %d rounds; model from %s (%s); %s",
        name, nodes, scenario.rounds, model.source, model.layout.describe(), keys.describe())
    return scenario, model


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

