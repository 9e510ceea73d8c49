"""Run a stock Flower app in this process under Quorum's ServerApp: ``quorum flower run APP_DIR``.

The app's ``pyproject.toml`` gives its ClientApp (``[tool.flwr.app.components]
clientapp``, imported from the app's folder, which goes on ``sys.path`` as
Flower puts it) and its run config (``[tool.flwr.app.config]``). The ClientApp
runs on the in-process grid, one virtual SuperNode per client with the node
config Flower's simulation gives (``partition-id``, ``num-partitions``), and
the server side is what ``flwr run`` runs under Quorum's ServerApp
(:func:`aggregator.flower_app.serve_flower_app`): the app's own model and
run-config keys, Quorum's round loop and run store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from flwr.clientapp import ClientApp

from aggregator.errors import AppModelError
from aggregator.flower_app import FlowerApp, read_app, serve_flower_app
from core.boundary import one_line
from core.records import RoundRecord
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.simulation import RunSummary, summarize

__all__ = ["run_flower_app", "load_client_app", "app_nodes", "app_run_config"]


def load_client_app(app: FlowerApp) -> ClientApp:
    """Import the app's ClientApp object from its folder and return it.

    Raises
    ------
    AppModelError
        It cannot be imported, or is not a ``ClientApp``.
    """
    from flwr.supercore.object_ref import load_app

    try:
        client_app = load_app(app.clientapp, AppModelError, app.path)
    except AppModelError as exc:  # Flower's: its first line says what; a paragraph of help follows
        first = next(iter(str(exc).strip().splitlines()), "")
        raise AppModelError(f"{app.clientapp} could not be loaded from {app.path}: {first} (the reference is "
                            "<module>:<attribute>)") from None
    except (Exception, SystemExit) as exc:  # the app's own module: whatever its import raises, sys.exit() included
        raise AppModelError(f"{app.clientapp} could not be imported from {app.path}: {one_line(exc)}") from exc
    if not isinstance(client_app, ClientApp):
        raise AppModelError(f"{app.clientapp} is a {type(client_app).__name__}, not a Flower ClientApp")
    return client_app


def app_nodes(clients: int) -> list[NodeSpec]:
    """``clients`` virtual SuperNodes (ids 1..n) with Flower's simulation node config."""
    return [NodeSpec(i + 1, {"partition-id": i, "num-partitions": clients}) for i in range(clients)]


def app_run_config(app: FlowerApp, rounds: int | None = None,
                   overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Return the app's run config with ``overrides`` (``flwr run --run-config``'s) applied.

    ``num-server-rounds`` is set to ``rounds`` when given.
    """
    config = {**app.config, **(overrides or {})}
    if rounds is not None:
        config["num-server-rounds"] = rounds
    return config


def run_flower_app(path: Path, *, clients: int, db_url: str, rounds: int | None = None,
                   overrides: Mapping[str, Any] | None = None, workers: int = 1,
                   on_round: Callable[[RoundRecord], None] | None = None,
                   on_start: Callable[[str], None] | None = None) -> RunSummary:
    """Run the Flower app in folder ``path`` with ``clients`` in-process clients; its stored run's summary.

    Raises
    ------
    AppModelError
        Not a Flower app, its ClientApp cannot be loaded, or no initial model (before a run exists).
    ScenarioError
        A refused or unusable run-config key (before a run exists).
    """
    started = time.monotonic()
    app = read_app(path)
    client_app = load_client_app(app)
    config = app_run_config(app, rounds, overrides)
    store = RunStore(db_url)
    with InProcessGrid(client_app, app_nodes(clients), config, workers=workers) as grid:
        context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
        run_id, _ = serve_flower_app(grid, context, store, app=app, engine="inprocess", wait_s=0.0,
                                     on_round=on_round, on_start=on_start)
    return summarize(store, run_id, time.monotonic() - started)
