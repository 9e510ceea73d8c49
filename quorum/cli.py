"""The ``quorum`` command: simulate, resume, list and report runs, and more.

Each package contributes its own sub-commands (``privacy``, ``dashboard``,
...); this module only assembles them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

import scenarios
from core.errors import QuorumError
from core.status import RunStatus
from dashboard.cli import app as dashboard_command
from deploy.agent_cli import app as client_app
from deploy.cli import app as aggregator_app
from privacy.dp.cli import app as privacy_app
from quorum.accounts_cli import accounts_app
from quorum.audit_cli import audit_command
from quorum.flower import app as flower_app
from quorum.submit_cli import submit_command
from runstore.store_url import default_db_url
from runtimes.parallel.cli import parallel as parallel_command
from scenarios.errors import ScenarioError

if TYPE_CHECKING:
    from runstore.store import Run, RunStore
    from runtimes.simulation import RunSummary

__all__ = ["app", "main"]

app = typer.Typer(help="Quorum: federated learning with secure aggregation, differential privacy "
                       "and a live dashboard.", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_show_locals=False)
console = Console(stderr=True, markup=False, highlight=False)  # every text printed as it is

DbOption = Annotated[str, typer.Option("--db", help="Run store: an SQLAlchemy URL.", envvar="QUORUM_DB")]
DEFAULT_DB = default_db_url()  # runs/quorum.db under the working directory


def _store(db: str) -> RunStore:
    """Open the run store at ``db``, or exit 2 with one line naming it and the fix (``runstore/opening.py``).

    Imported here: SQLAlchemy is most of a command's start-up.
    """
    from runstore.store import RunStore

    try:
        return RunStore(db)
    except QuorumError as exc:
        _fail(str(exc))


#: ``--json``'s status when simulate or resume drove no run to an ending: it refused (exit 2), or another process
#: took the run over (exit 1). Any other status is the run's own (``core.status``).
REFUSED, LOST = "refused", "lost"


def _fail(message: str, json_out: bool = False, run_id: str | None = None) -> NoReturn:
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)  # one line, unwrapped
    if json_out:
        _print_json({"run_id": run_id, "status": REFUSED, "error": message}, 2)
    raise typer.Exit(2)


def _print_json(fields: dict[str, object], code: int) -> None:
    sys.stdout.write(json.dumps({**fields, "exit_code": code}) + "\n")


@app.command()
def simulate(
    scenario: Annotated[Path, typer.Argument(help="Scenario TOML file, e.g. scenarios/quickstart.toml.")],
    rounds: Annotated[int | None, typer.Option(help="Override the scenario's number of rounds.")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the scenario's seed.")] = None,
    db: DbOption = DEFAULT_DB,
    engine: Annotated[str, typer.Option(help="inprocess (default, no Ray) or ray (needs quorum\\[simulation]).")]
    = "inprocess",
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of the live display, "
                                           "whatever the ending (README: the exit codes).")] = False,
    workers: Annotated[int | None, typer.Option(
        min=1, max=1024, help="In-process engine: worker processes that run clients, one call each at a time "
        "(default: one per core; 1 runs every client in this process).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        help="Ray engine: join the running Ray cluster at this address ('auto', or the head's host:port, "
        "from `ray start --head`) instead of starting a private one.")] = None,
    resume_on_failure: Annotated[bool, typer.Option(
        "--resume-on-failure", help="Start this same command twice or more (other hosts too) on one PostgreSQL "
        "--db: one process drives the run, the others wait and the first to notice its death takes the run "
        "over from its last committed round (docs/deploy.md, 'Two aggregators').")] = False,
) -> None:
    """Run a federation from a scenario file on this machine and store every round.

    Exit code: 0 finished, 3 degraded, 1 failed, interrupted (Ctrl-C) or lost to another process, 2 refused
    (nothing run); --json prints one JSON object whatever the ending.
    """
    from quorum.progress import RoundDisplay
    from runstore.lease import lease_seconds
    from runtimes.simulation import simulate as run
    from scenarios.schema import load_scenario

    if ray_address and engine != "ray":
        _fail(f"--ray-address {ray_address} needs --engine ray (the engine is {engine})", json_out)
    started: list[str] = []  # the run's id once it is stored: an error after that is the run failing
    since = time.monotonic()
    try:
        spec = load_scenario(scenario)
        overrides = {k: v for k, v in (("rounds", rounds), ("seed", seed)) if v is not None}
        if overrides:
            spec = spec.with_overrides(**overrides)
        lease_seconds()  # QUORUM_LEASE_S checked before the progress display opens: a bad one is its line alone
        with RoundDisplay(spec, enabled=not json_out) as display:

            def on_start(run_id: str) -> None:
                started.append(run_id)
                display.start(run_id)

            if resume_on_failure:
                from runtimes.standby import simulate_with_failover

                ended = simulate_with_failover(spec, db_url=db, say=lambda m: display.progress.console.print(m),
                                               engine=engine, on_round=display.update, on_start=on_start,
                                               workers=workers, ray_address=ray_address)
                if ended is None:  # only a stop event ends a standby's wait: none is given here
                    raise KeyboardInterrupt
                summary = ended
            else:
                summary = run(spec, db_url=db, engine=engine, on_round=display.update, on_start=on_start,
                              workers=workers, ray_address=ray_address)
    except (ScenarioError, QuorumError, KeyboardInterrupt) as exc:
        _stopped(exc, started[0] if started else None, db, since, json_out)
    _print_summary(summary, json_out)


def _stopped(exc: BaseException, run_id: str | None, db: str, since: float, json_out: bool) -> NoReturn:
    """End simulate or resume on ``exc`` (an error, or Ctrl-C) as run ``run_id`` (``None``: none yet) ended.

    Another process took the run: lost, exit 1. No run yet: refused, exit 2 (Ctrl-C: interrupted, exit 1).
    Else the ending ``run_federation`` stored (failed, interrupted) and its summary, exit 1.
    """
    from core.outcomes import EXIT_FAILED
    from runstore.store import LeaseLost
    from runtimes.simulation import summarize

    interrupted = isinstance(exc, KeyboardInterrupt)
    if isinstance(exc, LeaseLost) or (interrupted and run_id is None):
        said = "interrupted before a run was stored" if interrupted else str(exc)
        console.print(said, markup=False, highlight=False, soft_wrap=True)
        if json_out:
            _print_json({"run_id": run_id, "status": RunStatus.INTERRUPTED if interrupted else LOST, "error": said},
                        EXIT_FAILED)
        raise typer.Exit(EXIT_FAILED)
    if run_id is None:
        _fail(str(exc), json_out, getattr(exc, "run_id", None))
    if not interrupted and not json_out:  # the run's own words, on one line
        console.print(f"failed: run {run_id}: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_FAILED)
    with _store(db) as store:
        summary = summarize(store, run_id, time.monotonic() - since)
    _print_summary(summary, json_out)


@app.command()
def resume(
    run_id: Annotated[str | None, typer.Argument(
        help="The run to continue (its id, or a unique prefix of it); with --from: the new run's scenario file.",
        show_default=False)] = None,
    scenario: Annotated[Path | None, typer.Argument(
        help="The run's scenario file, checked against the stored one (default: the stored one).",
        show_default=False)] = None,
    from_run: Annotated[str | None, typer.Option("--from", help="Start a NEW run from a round of this run, "
                                                 "with its scenario or the one given.")] = None,
    from_round: Annotated[int | None, typer.Option("--round", min=1, help="With --from: the round whose checkpoint "
                                                   "the new run starts from (default: the last committed).")] = None,
    db: DbOption = DEFAULT_DB,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object, whatever the ending.")] = False,
    workers: Annotated[int | None, typer.Option(
        min=1, max=1024, help="In-process engine: worker processes (default: one per core).")] = None,
) -> None:
    r"""Continue an interrupted run (its process died) from its last committed round, with its own scenario.

    Another scenario is refused (exit 2), naming what differs, and so is a run another live process drives; a run
    that already ended is left untouched (its summary is printed, with its exit code). `quorum resume --from RUN
    --round N \[SCENARIO]` starts a new run from round N of RUN instead; the new run records its parent. Exit code
    as for simulate; --json prints one JSON object whatever the ending.
    """
    from quorum.progress import RoundDisplay
    from quorum.resume import plan_fork, plan_resume
    from runstore.takeover import TakenRunStore
    from runtimes.simulation import simulate as run
    from runtimes.simulation import summarize

    if from_run is None and (from_round is not None or run_id is None):
        _fail("name the run to continue (quorum resume RUN), or start a new run from one of its rounds "
              "(quorum resume --from RUN --round N [SCENARIO])", json_out)
    if from_run is not None and scenario is not None:
        _fail(f"--from {from_run} takes one argument at most, the new run's scenario file (got {run_id} and "
              f"{scenario})", json_out)
    started: list[str] = []  # the run's id once this process drives it
    since = time.monotonic()
    try:
        store = TakenRunStore(db)  # the run is taken for it before anything is written (quorum.resume)
        plan = (plan_resume(store, str(run_id), scenario) if from_run is None
                else plan_fork(store, from_run, from_round, Path(run_id) if run_id else None))
        if plan.note:
            console.print(plan.note, markup=False, highlight=False, soft_wrap=True)
        if plan.ended:
            summary = summarize(store, plan.run_id, 0.0)
        else:
            with RoundDisplay(plan.scenario, enabled=not json_out, done=plan.done) as display:
                summary = run(plan.scenario, db_url=db, engine=plan.engine, resume_id=plan.run_id,
                              on_round=display.update, on_start=started.append, workers=workers,
                              holder=plan.holder)
    except (ScenarioError, QuorumError, KeyboardInterrupt) as exc:
        _stopped(exc, started[0] if started else None, db, since, json_out)
    _print_summary(summary, json_out)


def _print_summary(summary: RunSummary, json_out: bool) -> NoReturn:
    """Print the run's ending, then exit with its code: 0 finished, 3 degraded, 1 otherwise (``core.outcomes``)."""
    from core.outcomes import exit_code

    code = exit_code(summary.status)
    if json_out:
        _print_json(summary.to_json(), code)
        raise typer.Exit(code)
    colour = {0: "green", 3: "yellow"}.get(code, "red")
    console.print(Text.assemble((summary.status, f"bold {colour}"), ": run ", (summary.run_id, "bold"),
                                f" ({summary.scenario}, {summary.rounds} rounds, {_final_metric(summary)}, "
                                f"{summary.wall_s:.1f} s)"))
    if summary.error:  # one line, the client's own words unmarked
        console.print(f"  {summary.status}: {summary.error}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  store:  {summary.db}")
    console.print(f"  report: quorum report {summary.run_id} --db {summary.db}")
    raise typer.Exit(code)


@app.command()
def runs(
    db: DbOption = DEFAULT_DB,
    status: Annotated[RunStatus | None, typer.Option(help="Only runs with this status.")] = None,
) -> None:
    """List the runs in the store, newest first.

    A run whose process stopped renewing its lease (killed, or its machine lost power) reads
    `interrupted`, with the time it was last seen; `quorum resume RUN` continues it.
    """
    from core.headline import format_value
    from runstore.report import run_summary

    store = _store(db)
    listed = [(run, run_summary(store, run.id)["metric"]) for run in store.list_runs(status)]
    names = {metric["name"] for _, metric in listed}
    shared = names.pop() if len(names) == 1 else None  # one task metric for all: it names the column
    table = Table(title=f"runs in {db}")
    best_column = "best" if shared is None else "best acc" if shared == "accuracy" else f"best {shared}"
    for col in ("run", "scenario", "status", "rounds", best_column, "strategy"):
        table.add_column(col)
    for run, metric in listed:
        best = "" if metric["best"] is None else format_value(metric["name"], metric["best"])
        table.add_row(run.id, run.name, _status_text(run), f"{run.rounds_done}/{run.rounds_total}",
                      f"{metric['name']} {best}" if shared is None and best else best, run.strategy)
    Console(markup=False).print(table)  # names and scenarios as written


def _final_metric(summary: RunSummary) -> str:
    """Format the run's headline metric after its last scored round: ``accuracy 91.20%``, ``c_index 0.7123``."""
    from core.headline import format_value

    metric = summary.metric or {"name": "accuracy", "final": summary.final_accuracy}
    return f"{metric['name']} {format_value(metric['name'], metric['final'], missing='n/a')}"


def _status_text(run: Run) -> str:
    """Return the status column: an interrupted run says when its process was last seen."""
    if run.status != RunStatus.INTERRUPTED or run.heartbeat_at is None:
        return run.status
    return f"interrupted (last seen {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(run.heartbeat_at))})"


@app.command()
def report(
    run_id: Annotated[str, typer.Argument(help="The run (its id, or a unique prefix of it).")],
    db: DbOption = DEFAULT_DB,
    out: Annotated[Path | None, typer.Option(help="Output folder (default runs/reports/RUN).")] = None,
) -> None:
    """Write PNG plots per round and a JSON summary of a run."""
    from runstore.report import write_report

    try:
        store = _store(db)
        run = store.get_run(run_id)
        paths = write_report(store, run.id, out or Path("runs") / "reports" / run.id)
    except QuorumError as exc:
        _fail(str(exc))
    for path in paths:
        console.print(f"wrote {path}")


@app.command()
def demo(
    scenario: Annotated[Path | None, typer.Argument(help="Scenario to run (default: the shipped quickstart).")]
    = None,
    db: DbOption = DEFAULT_DB,
    host: Annotated[str, typer.Option(help="Dashboard address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Dashboard port.")] = 8000,
    keep_serving: Annotated[bool, typer.Option(help="Keep the dashboard up after the run (Ctrl-C stops).")]
    = True,
) -> None:
    """Start the dashboard, run the quickstart federation, watch it live in the browser."""
    from quorum.demo import run_demo

    if scenario is None:  # the quickstart shipped with the package, wherever the command runs
        scenario = Path(scenarios.__file__).resolve().parent / "quickstart.toml"
    try:
        run_demo(scenario, db=db, host=host, port=port, keep_serving=keep_serving, console=console)
    except (ScenarioError, QuorumError) as exc:
        _fail(str(exc))


@app.command()
def new(
    name: Annotated[Path, typer.Argument(help="The project folder to create, e.g. my-task.")],
) -> None:
    """Create a project: task.py (your model, data, training loop), scenario.toml and a README."""
    from quorum.new import ProjectError, create_project

    try:
        paths = create_project(name)
    except (ProjectError, OSError) as exc:
        _fail(str(exc))
    for path in paths:
        console.print(f"wrote {path}")
    console.print(f"run it:  quorum simulate {name / 'scenario.toml'}")


@app.command()
def export(
    run_id: Annotated[str, typer.Argument(help="The run (its id, or a unique prefix of it).")],
    out: Annotated[Path, typer.Option("--out", help="Folder to write model.safetensors and quorum-model.json to.")],
    round_: Annotated[int | None, typer.Option("--round", min=1, help="Export the model after this round "
                                               "(default: the last committed).")] = None,
    merged: Annotated[bool, typer.Option("--merged", help="Language-model runs: also write the base model with "
                                         "the LoRA adapters folded in (OUT/merged).")] = False,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Write a run's global model (safetensors + manifest); load it with quorum.load_model(DIR).

    A language-model run writes its LoRA adapters in peft's layout (adapter_model.safetensors, adapter_config.json).
    """
    from quorum.export import export_run

    try:
        path = export_run(_store(db), run_id, out, round_, merged=merged)
    except (QuorumError, OSError) as exc:
        _fail(str(exc))
    weights = json.loads(path.read_text(encoding="utf-8"))["weights"]
    console.print(f"wrote {out / weights} and {path}" + (f", and {out / 'merged'}" if merged else ""))
    console.print(f"serve it: quorum serve {out}")


LOOPBACK = ("127.0.0.1", "::1", "localhost")


@app.command()
def serve(
    model_dir: Annotated[Path, typer.Argument(help="A folder written by `quorum export`.")],
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8080,
    max_batch: Annotated[int, typer.Option(min=1, max=65536, help="Most examples per request.")] = 256,
    allow_remote: Annotated[bool, typer.Option(help="Allow a non-loopback --host (the API has no "
                                               "authentication: put it behind your own front door).")] = False,
) -> None:
    """Answer POST /predict with batched predictions of an exported model (POST /generate for a language model)."""
    import uvicorn

    from quorum.serve import create_app

    if host not in LOOPBACK and not allow_remote:
        _fail(f"--host {host} is not loopback and the prediction API has no authentication; "
              "pass --allow-remote to bind it anyway")
    try:
        api = create_app(model_dir, max_batch=max_batch)
    except QuorumError as exc:
        _fail(str(exc))
    route = "generate" if any(getattr(r, "path", "") == "/generate" for r in api.routes) else "predict"
    console.print(f"serving {model_dir} on http://{host}:{port}/{route}")
    uvicorn.run(api, host=host, port=port, log_level="warning", ws="none")  # no websockets: plain HTTP only


def _mount_subcommands() -> None:
    """Sub-commands owned by other packages (each imports its heavy code only when it runs)."""
    app.add_typer(privacy_app, name="privacy",
                  help="Plan differential privacy: epsilon for a plan, noise for a target.")
    app.command(name="dashboard")(dashboard_command)
    app.add_typer(aggregator_app, name="aggregator",
                  help="Run the aggregator of a real federation (SuperLink behind TLS).")
    app.add_typer(client_app, name="client", help="Enroll, revoke and run edge client agents.")
    app.command(name="parallel")(parallel_command)
    app.command(name="audit")(audit_command)
    app.command(name="submit")(submit_command)
    app.add_typer(flower_app, name="flower", help="Run a stock Flower app in this process under Quorum's ServerApp.")
    app.add_typer(accounts_app, name="accounts",
                  help="Accounts and API tokens for the dashboard: who may do what (roles, organisations).")


_mount_subcommands()


def main() -> None:
    """Run the ``quorum`` command line."""
    app()
