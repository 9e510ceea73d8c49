"""``quorum flower run APP_DIR``: a stock Flower app, in this process, under Quorum's ServerApp.

The app's ClientApp (its ``pyproject.toml``'s ``clientapp``) runs unchanged on
the in-process grid; the server side is what ``flwr run`` runs when the app's
``serverapp`` is ``aggregator.serverapp:app``: the app's own model and run-config
keys, Quorum's round loop, the run store (``runtimes.flower_app``). One line per
round, then how the run ended; the exit code is ``quorum simulate``'s (0
finished, 3 degraded, 1 failed, 2 nothing ran), whatever code the app's own
code exits with: its ServerApp, run for the model, that exits with its own
code (``sys.exit(3)``) or sends no message within ``--first-message-timeout``
fails the run, and the line says so. A folder that is no usable app (its
``pyproject.toml`` unreadable, its ClientApp not importable) is one line and 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from core.errors import QuorumError
from runstore.store_url import default_db_url
from scenarios.errors import ScenarioError
from scenarios.flower_app import FIRST_MESSAGE_KEY, FIRST_MESSAGE_S, MAX_FIRST_MESSAGE_S, check_seconds

if TYPE_CHECKING:
    from core.records import RoundRecord

__all__ = ["app"]

app = typer.Typer(help="Run a stock Flower app (its own ClientApp, model and run config) under Quorum's ServerApp.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_show_locals=False)
console = Console(stderr=True, markup=False, highlight=False)  # every text printed as it is


@app.command()
def run(
    app_dir: Annotated[Path, typer.Argument(help="The Flower app's folder (its pyproject.toml names its clientapp).")],
    clients: Annotated[int, typer.Option(min=1, max=10_000, help="In-process clients (virtual SuperNodes).")] = 2,
    rounds: Annotated[int | None, typer.Option(min=1, help="Rounds (the app's num-server-rounds by default).")]
    = None,
    run_config: Annotated[str, typer.Option("--run-config", help="Overrides of the app's run config, as JSON "
                                            "(e.g. '{\"learning-rate\": 0.05}').")] = "{}",
    db: Annotated[str, typer.Option("--db", help="Run store: an SQLAlchemy URL.", envvar="QUORUM_DB")]
    = default_db_url(),
    workers: Annotated[int, typer.Option(min=1, max=1024, help="Client calls at a time, on that many forked "
                                         "worker processes (1: every client in this process).")] = 1,
    first_message_timeout: Annotated[float | None, typer.Option(
        "--first-message-timeout", metavar="SECONDS",
        help=f"Seconds the app's own ServerApp, run for its initial model, has to send its first message; then "
             f"it is stopped and the run fails (the app's run config {FIRST_MESSAGE_KEY}, else "
             f"{FIRST_MESSAGE_S:g}; at most {MAX_FIRST_MESSAGE_S:g}).")] = None,
) -> None:
    """Run a Flower app's federation in this process and store every round (`quorum runs`, the dashboard)."""
    from aggregator.flower_app import round_text
    from core.outcomes import exit_code
    from runtimes.flower_app import run_flower_app

    try:
        overrides = json.loads(run_config)
    except json.JSONDecodeError as exc:
        _fail(f"--run-config is not JSON: {exc}")
    if not isinstance(overrides, dict):
        _fail(f"--run-config must be a JSON object, got {run_config}")
    if first_message_timeout is not None:
        try:
            overrides[FIRST_MESSAGE_KEY] = check_seconds("--first-message-timeout", first_message_timeout)
        except ScenarioError as exc:
            _fail(str(exc))
    total: list[int] = []

    def on_round(record: RoundRecord) -> None:
        console.print(round_text(record, total[0] if total else record.round), markup=False, highlight=False,
                      soft_wrap=True)

    def on_start(run_id: str) -> None:
        console.print(f"run {run_id} started: {app_dir}", markup=False, highlight=False, soft_wrap=True)

    try:
        total.append(rounds or _rounds_of(app_dir, overrides))
        summary = run_flower_app(app_dir, clients=clients, rounds=rounds, overrides=overrides, db_url=db,
                                 workers=workers, on_round=on_round, on_start=on_start)
    except (ScenarioError, QuorumError) as exc:
        _fail(str(exc))
    code = exit_code(summary.status)
    accuracy = f", accuracy {summary.final_accuracy:.2%}" if summary.final_accuracy is not None else ""
    console.print(f"{summary.status}: run {summary.run_id} ({summary.scenario}, {summary.rounds} rounds{accuracy}, "
                  f"{summary.wall_s:.1f} s)", markup=False, highlight=False)
    if summary.error:
        console.print(f"  {summary.status}: {summary.error}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  store:  {summary.db}", markup=False, highlight=False)
    raise typer.Exit(code)


def _rounds_of(app_dir: Path, overrides: dict[str, Any]) -> int:
    """Return the app's rounds, for the round lines' "of N" (its num-server-rounds, Flower's 3 when absent)."""
    from aggregator.flower_app import read_app

    value = {**read_app(app_dir).config, **overrides}.get("num-server-rounds", 3)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 3


def _fail(message: str) -> None:
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(2)
