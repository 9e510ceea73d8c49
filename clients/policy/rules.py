"""What a round asks of a device, and which rules of its site policy that breaks.

:class:`RoundAsk` is read by the device from what it received and what it
will itself do (:func:`clients.policy.mod.round_ask`), or from a scenario when
``quorum client policy check`` asks what the device would do with a run
(:func:`scenario_ask`). :func:`refusals` is a pure function of the policy, the
ask and the device's own count of the rounds it trained.

A task is identified by the SHA-256 of the file that defines its class, as
this device imports it (:func:`task_digest`): the code that would read the
data, not a name the aggregator sends.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
from dataclasses import dataclass
from pathlib import Path

from clients.policy.spec import SitePolicy
from learning.task import task_class
from privacy.dp.accountant import plan_epsilon
from privacy.dp.errors import DPConfigError
from scenarios.schema import Scenario
from scenarios.sections import TaskSpec
from scenarios.threats import DPSpec

__all__ = ["RoundAsk", "refusals", "run_epsilon", "task_digest", "scenario_ask", "SECURE_AGGREGATION_REQUIRED"]

#: The reason of a plain round refused under ``require_secure_aggregation``.
SECURE_AGGREGATION_REQUIRED = "secure aggregation required"


@dataclass(frozen=True)
class RoundAsk:
    """What one message asks of a device.

    Attributes
    ----------
    evaluation : bool
        An evaluation of the global model (only ``allowed_tasks`` applies), not training.
    secure : bool
        The device's update will be masked by secure aggregation (the protocol
        ran its earlier stages on this node for this round).
    epsilon : float | None
        The run's client-level DP budget (``inf`` when the noise is none);
        ``None`` when the round carries no client-level DP.
    cohort : int | None
        The clients of the round, as the instruction states; ``None`` when it does not.
    task : str
        The SHA-256 of the task's source (:func:`task_digest`); ``""`` when not asked for or unknown.
    trains : bool
        Whether it trains a model (counted against ``max_rounds_per_day``), not a statistics pass.
    """

    evaluation: bool = False
    secure: bool = False
    epsilon: float | None = None
    cohort: int | None = None
    task: str = ""
    trains: bool = True


def refusals(policy: SitePolicy, ask: RoundAsk, trained_today: int = 0) -> list[str]:
    """Return the reason of each rule ``ask`` breaks, in the order of the policy's keys (empty: accepted).

    ``trained_today`` is how many rounds the device trained in the last 24
    hours (:class:`clients.policy.ledger.RoundLedger`). An evaluation is held
    to ``allowed_tasks`` only: it trains nothing and sends no update.
    """
    found: list[str] = []
    if not ask.evaluation:
        if policy.require_secure_aggregation and not ask.secure:
            found.append(SECURE_AGGREGATION_REQUIRED)
        found += _epsilon_rule(policy.max_epsilon, ask.epsilon)
        found += _cohort_rule(policy.min_cohort, ask.cohort)
    if policy.allowed_tasks is not None and ask.task not in policy.allowed_tasks:
        found.append(f"task {ask.task[:12] or '(unidentified)'} not in allowed_tasks")
    if not ask.evaluation and ask.trains and policy.max_rounds_per_day is not None \
            and trained_today >= policy.max_rounds_per_day:
        found.append(f"{trained_today} rounds trained in the last 24 h "
                     f"(max_rounds_per_day = {policy.max_rounds_per_day})")
    return found


def _epsilon_rule(limit: float | None, epsilon: float | None) -> list[str]:
    if limit is None:
        return []
    if epsilon is None:
        return [f"no client-level DP (max_epsilon = {limit:g})"]
    return [f"DP budget epsilon {epsilon:.4g} over max_epsilon {limit:g}"] if not epsilon <= limit else []


def _cohort_rule(least: int | None, cohort: int | None) -> list[str]:
    if least is None:
        return []
    if cohort is None:
        return [f"the round states no cohort (min_cohort = {least})"]
    return [f"cohort {cohort} under min_cohort {least}"] if cohort < least else []


def run_epsilon(scenario: Scenario) -> float | None:
    """Return the run's client-level DP budget; ``None`` without ``[dp] enabled``.

    ``target_epsilon`` when the scenario gives it (the run stops before
    spending more); else what ``noise_multiplier`` spends over the scenario's
    rounds, from the same accountant the aggregator uses (``inf`` for no noise,
    or settings it cannot account).
    """
    fed = scenario.federation
    return _epsilon_of(scenario.dp, fed.per_round, fed.clients, scenario.rounds)


@functools.lru_cache(maxsize=32)
def _epsilon_of(dp: DPSpec, per_round: int, clients: int, rounds: int) -> float | None:
    if not dp.enabled:
        return None
    if dp.noise_multiplier is None:
        return dp.target_epsilon  # the noise is derived from it
    try:
        planned = plan_epsilon(min(1.0, per_round / clients), rounds, dp.noise_multiplier, dp.delta, dp.sampling)
    except DPConfigError:
        planned = math.inf
    return planned if dp.target_epsilon is None else min(planned, dp.target_epsilon)


def task_digest(spec: TaskSpec) -> str:
    """Return the SHA-256 (hex) of the file that defines the task's class, as this device imports it.

    Importing the task's module runs no task code on data; nothing is read
    but the source file.

    Raises
    ------
    scenarios.errors.ScenarioError
        The entry cannot be imported (from :func:`learning.task.task_class`).
    OSError, TypeError
        The class has no source file that can be read.
    """
    source = inspect.getsourcefile(task_class(spec))
    if source is None:
        raise TypeError(f"task {spec.entry or 'built-in'} has no source file")
    path = Path(source)
    stat = path.stat()
    return _digest(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    del mtime_ns, size  # the cache key: an edited file is hashed again
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def scenario_ask(scenario: Scenario, task: str = "") -> RoundAsk:
    """Return what a run of ``scenario`` asks of every round: its settings, its expected cohort, ``task``'s digest."""
    epsilon = run_epsilon(scenario)
    return RoundAsk(secure=scenario.secagg.enabled, epsilon=epsilon, cohort=scenario.federation.per_round,
                    task=task)
