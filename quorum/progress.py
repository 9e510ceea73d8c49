"""The live display of ``quorum simulate``: a progress bar and one line per round.

A round's line leads with the task's headline metric (``acc`` for accuracy,
else its own name: ``c_index 0.7123``), then every other metric the task
returned from the same place (the server's held-out set, else the clients'
test splits).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from core.headline import Headline, format_value, round_scores, round_value
from core.outcomes import count, edges_line, round_line
from core.records import RoundRecord
from learning.task import task_class, task_headline
from scenarios.schema import Scenario

__all__ = ["RoundDisplay"]


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


class RoundDisplay:
    """Rich progress over rounds; silent when ``enabled`` is False (``--json``)."""

    def __init__(self, scenario: Scenario, *, enabled: bool = True, done: int = 0,
                 headline: Headline | None = None) -> None:
        self.enabled = enabled
        self.headline = headline or _declared(scenario)
        self.console = Console(stderr=True, markup=False, highlight=False)  # names and reasons as they are
        self.progress = Progress(TextColumn("{task.description}", style="bold", markup=False), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, disable=not enabled)
        self.task = self.progress.add_task(f"{scenario.name}", total=scenario.rounds, completed=done)

    def __enter__(self) -> RoundDisplay:
        """Start the progress bar."""
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        """Stop the progress bar."""
        self.progress.stop()

    def start(self, run_id: str) -> None:
        """Print that run ``run_id`` started (when enabled)."""
        if self.enabled:
            self.progress.console.print(Text.assemble("run ", (run_id, "bold"), " started"))

    def update(self, record: RoundRecord) -> None:
        """Print one line for the round (when enabled) and advance the bar by one."""
        loss = record.server_loss if record.server_loss is not None else record.fed_loss
        eps = f"  eps {record.epsilon:.3f}" if record.epsilon is not None else ""
        clock = (record.metrics or {}).get("virtual-time-s")  # an asynchronous (FedBuff) step
        if isinstance(clock, (int, float)):
            eps += f"  virtual {clock:.1f}s, staleness max {(record.metrics or {}).get('staleness-max', 0)}"
        kind = "step " if isinstance(clock, (int, float)) else "round"
        line = (f"{kind} {record.round:>3}  loss {_fmt(loss, '.4f')}  {self._scores(record)}  "
                f"train-loss {_fmt(record.train_loss, '.4f')}  {record.duration_s:.1f}s{eps}  "
                f"clients {round_line(record.sampled, count(record.clients))}{edges_line(record.tree)}")
        if self.enabled:  # a client's reason is its own text: no rich markup in it
            self.progress.console.print(line, highlight=False, markup=False)
        self.progress.advance(self.task)

    def _scores(self, record: RoundRecord) -> str:
        """Format the headline metric, then the task's others from the same split: ``c_index 0.7123  mae 1.234``.

        With both splits, the federated headline follows the server's: ``acc 91.20% (fed 89.75%)``.
        """
        name = self.headline.name
        value, split = round_value(self.headline, record)
        label = "acc" if name == "accuracy" else name
        scores = round_scores(record)
        head = f"{label} {format_value(name, value)}"
        federated = scores.get("federated", {}).get(name)
        if split == "server" and federated is not None:
            head += f" (fed {format_value(name, federated)})"
        others = scores.get(split or "", {})
        rest = [f"{k} {format_value(k, v)}" for k, v in sorted(others.items()) if k not in (name, "loss")]
        return "  ".join([head, *rest])


def _declared(scenario: Scenario) -> Headline:
    """Return the headline metric the scenario's task declares (its class is imported, not built)."""
    spec = scenario.task
    return task_headline(task_class(spec), spec.source or scenario.name, spec.entry)
