"""``quorum parallel``: train a scenario data-parallel on this machine's cores.

:func:`parallel` is mounted on the ``quorum`` app; ``python -m
runtimes.parallel`` runs it on its own. Importing this module loads no
torch: the launcher is imported when the command runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from core.errors import QuorumError
from runstore.store_url import default_db_url
from runtimes.parallel.mode import CommHook, Mode
from scenarios.errors import ScenarioError

__all__ = ["parallel", "app"]

_console = Console(stderr=True)


def parallel(
    scenario: Annotated[Path, typer.Argument(help="Scenario TOML file, e.g. scenarios/quickstart.toml.")],
    nproc: Annotated[int, typer.Option("--nproc", help="Worker processes on this machine (at most the "
                                       "scenario's clients).")] = 2,
    mode: Annotated[Mode, typer.Option(help="sync: gradients averaged every step; localsgd: local epochs "
                                       "(or --local-steps), then models averaged and the strategy applied.")]
    = Mode.SYNC,
    local_steps: Annotated[int, typer.Option(help="localsgd: H local steps per round instead of the "
                                             "scenario's local_epochs (0 keeps epochs).")] = 0,
    comm_hook: Annotated[CommHook, typer.Option(help="sync: train through torch's DDP with this gradient "
                                                "compression hook (fp16: half the bytes; powersgd: rank-1 "
                                                "factors; bf16 needs NCCL) instead of the core's float32 "
                                                "all-reduce. localsgd compresses with \\[compression].")]
    = CommHook.NONE,
    db: Annotated[str, typer.Option("--db", help="Run store: an SQLAlchemy URL.", envvar="QUORUM_DB")]
    = default_db_url(),
    rounds: Annotated[int | None, typer.Option(help="Override the scenario's number of rounds.")] = None,
    seed: Annotated[int | None, typer.Option(help="Override the scenario's seed.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds a collective waits for the other workers before "
                                           "the job fails.")] = 120.0,
    bucket_mb: Annotated[float, typer.Option(help="All-reduce bucket size in MiB.")] = 25.0,
    threads: Annotated[int, typer.Option(help="Torch threads per worker (0: cores / workers).")] = 0,
    max_restarts: Annotated[int, typer.Option(help="Elastic restarts of the worker group after a failure; "
                                              "restarted workers resume from the last committed round.")] = 0,
    resume: Annotated[str | None, typer.Option(help="Continue this stored parallel run.")] = None,
    pid_dir: Annotated[Path | None, typer.Option(hidden=True, help="Write rankN.pid files here.")] = None,
    print_command: Annotated[bool, typer.Option("--print-command", help="Print the equivalent torchrun "
                                                "command and exit.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")] = False,
) -> None:
    """Train a scenario data-parallel over torch.distributed (gloo).

    Workers are combined through the aggregation core, and every round is
    stored like a federated run (engine "parallel").
    """
    from runtimes.parallel.launch import LaunchSpec, launch, torchrun_command  # torch loads here, not at CLI start

    spec = LaunchSpec(scenario=scenario, nproc=nproc, mode=mode, local_steps=local_steps, comm_hook=comm_hook,
                      db=db, rounds=rounds,
                      seed=seed, timeout_s=timeout, bucket_mb=bucket_mb, threads=threads,
                      max_restarts=max_restarts, resume=resume, pid_dir=pid_dir)
    if print_command:
        sys.stdout.write(torchrun_command(spec, resume) + "\n")
        return
    try:
        summary = launch(spec)
    except (ScenarioError, QuorumError) as exc:
        _console.print(Text.assemble(("error:", "bold red"), " ", str(exc)), soft_wrap=True)
        raise typer.Exit(2) from None
    if json_out:
        sys.stdout.write(json.dumps({**summary.to_json(), "engine": "parallel", "mode": mode.value,
                                     "nproc": nproc}) + "\n")
        return
    acc = "n/a" if summary.final_accuracy is None else f"{summary.final_accuracy:.2%}"
    _console.print(Text.assemble((summary.status, "bold green"), ": run ", (summary.run_id, "bold"),
                                 f" ({summary.scenario}, {mode.value}, {nproc} workers, {summary.rounds} rounds, "
                                 f"accuracy {acc}, {summary.wall_s:.1f} s)"))
    _console.print(f"  store:  {summary.db}", highlight=False)


app = parallel  # what ``quorum.cli._mount_subcommands`` mounts: ``app.command(name="parallel")(app)``
