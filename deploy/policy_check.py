"""``quorum client policy check``: which runs this device's site policy would accept, and why not.

Each target (a scenario file, or a run of a run store) is judged as a round
of it would be on this device (:mod:`clients.policy.rules`): the scenario's
secure aggregation, its DP budget, the cohort its federation samples each
round, the SHA-256 of its task as this machine imports it, and the rounds
this device trained in the last 24 hours (its own count). What only a round
can tell (a Poisson-sampled cohort smaller than planned, the protocol
actually running) is checked again on the device for every round.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.policy.rules import refusals, scenario_ask, task_digest
from clients.policy.spec import SitePolicy
from core.errors import QuorumError
from core.status import RunStatus
from runstore.store import RunStore
from scenarios.schema import Scenario, load_scenario, scenario_from_dict

__all__ = ["Verdict", "judge", "check_scenarios", "check_store"]


@dataclass(frozen=True)
class Verdict:
    """What the device would do with one target: accept it (no reasons), refuse it (the rules), or not know."""

    target: str
    reasons: tuple[str, ...] = ()
    task: str = ""  # the SHA-256 of the task's source here: "" when it cannot be imported here
    error: str | None = None  # the target cannot be read (a bad scenario, a task missing here)

    @property
    def accepted(self) -> bool:
        """Whether the device would accept the target's rounds."""
        return not self.reasons and self.error is None

    def line(self) -> str:
        """One line for a terminal: ``run 2026-... (name): refused: secure aggregation required``."""
        if self.error is not None and not self.reasons:
            return f"{self.target}: cannot tell: {self.error}"
        verdict = "accepted" if not self.reasons else "refused: " + "; ".join(self.reasons)
        return f"{self.target}: {verdict}" + (f" (task sha256 {self.task})" if self.task else "")

    def to_json(self) -> dict[str, Any]:
        """Return the verdict as a JSON object."""
        return {"target": self.target, "accepted": self.accepted, "reasons": list(self.reasons),
                "task_sha256": self.task or None, "error": self.error}


def judge(policy: SitePolicy, scenario: Scenario, target: str, trained_today: int = 0) -> Verdict:
    """Judge a run of ``scenario`` against ``policy``, its task hashed as this machine imports it."""
    try:
        task, error = task_digest(scenario.task), None
    except Exception as exc:  # a user's task module: whatever its import raises is the reason here
        task, error = "", f"the task {scenario.task.entry or '(built-in)'} cannot be read here: {exc}"
    reasons = refusals(policy, scenario_ask(scenario, task), trained_today)
    return Verdict(target, tuple(reasons), task, error if policy.allowed_tasks is not None else None)


def check_scenarios(policy: SitePolicy, paths: Sequence[Path], trained_today: int = 0) -> list[Verdict]:
    """Judge each scenario file; one that cannot be read is a verdict with its error."""
    verdicts = []
    for path in paths:
        try:
            scenario = load_scenario(path)
        except QuorumError as exc:
            verdicts.append(Verdict(str(path), error=str(exc)))
            continue
        verdicts.append(judge(policy, scenario, f"{path} ({scenario.name})", trained_today))
    return verdicts


def check_store(policy: SitePolicy, db_url: str, every: bool = False, trained_today: int = 0) -> list[Verdict]:
    """Judge the runs of the run store at ``db_url``: those running (the current runs), or ``every`` one."""
    with RunStore(db_url) as store:
        runs = store.list_runs(None if every else RunStatus.RUNNING)
    return list(_judged(policy, runs, trained_today))


def _judged(policy: SitePolicy, runs: Iterable[Any], trained_today: int) -> Iterable[Verdict]:
    for run in runs:
        target = f"run {run.id} ({run.name}, {run.status})"
        try:
            scenario = scenario_from_dict(run.scenario, source=f"run {run.id}")
        except QuorumError as exc:
            yield Verdict(target, error=str(exc))
            continue
        yield judge(policy, scenario, target, trained_today)
