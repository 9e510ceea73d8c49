"""``quorum privacy``: plan a DP run before starting it.

``quorum privacy epsilon --rate Q --rounds T --noise Z --delta D`` prints the
epsilon a run will spend; ``quorum privacy noise --epsilon E --rate Q
--rounds T --delta D`` prints the noise multiplier a budget needs. Both use
the RDP accountant of ``dp-accounting``, exactly as the round loop does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from privacy.dp.errors import DPConfigError

__all__ = ["app"]

app = typer.Typer(help="Differential privacy planning (client-level DP-FedAvg, RDP accountant).",
                  no_args_is_help=True, add_completion=False)


class SamplingChoice(StrEnum):
    poisson = "poisson"
    fixed = "fixed"


Rate = Annotated[float, typer.Option("--rate", "-q", help="Clients per round / population, in (0, 1].")]
Rounds = Annotated[int, typer.Option("--rounds", "-t", help="Number of rounds.")]
Delta = Annotated[float, typer.Option("--delta", "-d", help="Target delta (below 1 / population).")]
SamplingOpt = Annotated[SamplingChoice, typer.Option("--sampling", help="Client sampling scheme.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")]


@app.command()
def epsilon(rate: Rate, rounds: Rounds,
            noise: Annotated[float, typer.Option("--noise", "-z", help="Noise multiplier z (std / clip).")],
            delta: Delta = 1e-5, sampling: SamplingOpt = SamplingChoice.poisson, as_json: AsJson = False) -> None:
    """Epsilon spent by ROUNDS rounds at sampling rate RATE and noise multiplier NOISE."""
    from privacy.dp.accountant import plan_epsilon

    eps = _or_exit(lambda: plan_epsilon(rate, rounds, noise, delta, sampling.value))
    _show({"rate": rate, "rounds": rounds, "noise_multiplier": noise, "delta": delta,
           "sampling": sampling.value, "epsilon": eps}, "epsilon", as_json)


@app.command()
def noise(target_epsilon: Annotated[float, typer.Option("--epsilon", "-e", help="Budget to stay within.")],
          rate: Rate, rounds: Rounds, delta: Delta = 1e-5, sampling: SamplingOpt = SamplingChoice.poisson,
          as_json: AsJson = False) -> None:
    """Smallest noise multiplier that keeps ROUNDS rounds within the target epsilon."""
    from privacy.dp.accountant import noise_for_epsilon, plan_epsilon

    z = _or_exit(lambda: noise_for_epsilon(target_epsilon, rate, rounds, delta, sampling.value))
    eps = plan_epsilon(rate, rounds, z, delta, sampling.value)
    _show({"target_epsilon": target_epsilon, "rate": rate, "rounds": rounds, "delta": delta,
           "sampling": sampling.value, "noise_multiplier": z, "epsilon": eps}, "noise_multiplier", as_json)


def _or_exit(compute: Callable[[], float]) -> float:
    try:
        return compute()
    except DPConfigError as exc:
        Console(stderr=True).print(Text.assemble(("error:", "red"), " ", str(exc)), soft_wrap=True)
        raise typer.Exit(code=2) from None


def _show(figures: dict[str, object], answer: str, as_json: bool) -> None:
    console = Console()
    if as_json:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}
        console.print_json(json.dumps(clean))
        return
    table = Table(title="DP-FedAvg plan (RDP)", show_header=False)
    for key, value in figures.items():
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        table.add_row(key, Text(text, "bold green") if key == answer else Text(text))
    console.print(table)
