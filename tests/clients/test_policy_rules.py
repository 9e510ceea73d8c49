"""Each rule of a site policy, the device's own round count and the task's identity (issue 48, item 5).

Pure functions and a file in ``tmp_path``: no ClientApp, no socket, no process.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest

from clients.policy.errors import PolicyError
from clients.policy.ledger import DAY_S, RoundLedger
from clients.policy.rules import RoundAsk, refusals, run_epsilon, scenario_ask, task_digest
from clients.policy.spec import SitePolicy
from scenarios.sections import TaskSpec
from tests.conftest import tiny_scenario

DIGEST = "ab" * 32


# ------------------------------------------------------------------------------------- the rules

def test_a_round_that_keeps_every_rule_is_accepted() -> None:
    policy = SitePolicy(require_secure_aggregation=True, max_epsilon=8.0, min_cohort=5,
                        allowed_tasks=frozenset({DIGEST}), max_rounds_per_day=24)
    ask = RoundAsk(secure=True, epsilon=8.0, cohort=5, task=DIGEST)  # each at its bound: allowed

    assert refusals(policy, ask, trained_today=23) == []


def test_each_broken_rule_is_named_in_the_order_of_the_keys() -> None:
    # Prepare: a plain round of 3 clients, epsilon 10, an unlisted task, on a device that trained 24 rounds today
    policy = SitePolicy(require_secure_aggregation=True, max_epsilon=8.0, min_cohort=5,
                        allowed_tasks=frozenset({DIGEST}), max_rounds_per_day=24)
    ask = RoundAsk(secure=False, epsilon=10.0, cohort=3, task="cd" * 32)

    # Execute
    found = refusals(policy, ask, trained_today=24)

    # Assert
    assert found == ["secure aggregation required", "DP budget epsilon 10 over max_epsilon 8",
                     "cohort 3 under min_cohort 5", "task cdcdcdcdcdcd not in allowed_tasks",
                     "24 rounds trained in the last 24 h (max_rounds_per_day = 24)"]


def test_what_a_round_does_not_state_is_refused_when_a_rule_needs_it() -> None:
    policy = SitePolicy(max_epsilon=8.0, min_cohort=5, allowed_tasks=frozenset({DIGEST}))

    found = refusals(policy, RoundAsk(epsilon=None, cohort=None, task=""))

    assert found == ["no client-level DP (max_epsilon = 8)", "the round states no cohort (min_cohort = 5)",
                     "task (unidentified) not in allowed_tasks"]


def test_an_evaluation_is_held_to_the_task_rule_only_and_a_statistics_pass_is_not_counted() -> None:
    policy = SitePolicy(require_secure_aggregation=True, max_epsilon=1.0, min_cohort=50,
                        allowed_tasks=frozenset({DIGEST}), max_rounds_per_day=1)

    evaluation = refusals(policy, RoundAsk(evaluation=True, task=DIGEST), trained_today=5)
    unlisted = refusals(policy, RoundAsk(evaluation=True, task="ef" * 32), trained_today=5)
    statistics = refusals(SitePolicy(max_rounds_per_day=1), RoundAsk(trains=False), trained_today=5)

    assert evaluation == [] and statistics == []
    assert unlisted == ["task efefefefefef not in allowed_tasks"]


def test_no_noise_is_an_infinite_budget_over_any_limit() -> None:
    assert refusals(SitePolicy(max_epsilon=1000.0), RoundAsk(epsilon=math.inf)) == [
        "DP budget epsilon inf over max_epsilon 1000"]


# ---------------------------------------------------------------------------- the run's DP budget

def test_the_budget_is_what_the_noise_spends_over_the_run_or_the_target_if_lower() -> None:
    # Prepare: q = 1/10, T = 100, z = 1, delta = 1e-5: McMahan et al. (ICLR 2018)'s setting, epsilon 7.90
    fed = {"clients": 10, "fraction": 0.1, "min_clients": 1}
    noise_only = tiny_scenario(rounds=100, federation=fed, dp={"enabled": True, "noise_multiplier": 1.0})
    capped = tiny_scenario(rounds=100, federation=fed,
                           dp={"enabled": True, "noise_multiplier": 1.0, "target_epsilon": 3.0})
    target_only = tiny_scenario(rounds=100, federation=fed, dp={"enabled": True, "target_epsilon": 2.5})

    # Execute / Assert
    assert run_epsilon(noise_only) == pytest.approx(7.90, abs=0.005)
    assert run_epsilon(capped) == 3.0 and run_epsilon(target_only) == 2.5
    assert run_epsilon(tiny_scenario()) is None
    assert refusals(SitePolicy(max_epsilon=7.5), scenario_ask(noise_only)) == [
        "DP budget epsilon 7.904 over max_epsilon 7.5"]
    assert refusals(SitePolicy(max_epsilon=8.0), scenario_ask(noise_only)) == []


def test_a_scenario_asks_its_secure_aggregation_and_its_cohort() -> None:
    scenario = tiny_scenario(federation={"clients": 6, "fraction": 0.5}, secagg={"enabled": True})

    ask = scenario_ask(scenario, task=DIGEST)

    assert (ask.secure, ask.cohort, ask.epsilon, ask.task, ask.evaluation) == (True, 3, None, DIGEST, False)


# ----------------------------------------------------------------------------------- the task's identity

TASK = '''
class PolicyProbeTask:
    def build_model(self, seed): ...
    def partition(self, partition_id): ...
    def train(self, model, data, config, seed): ...
    def evaluate(self, model, data): ...
'''


def test_a_task_is_the_sha256_of_the_file_defining_its_class_and_an_edit_changes_it(tmp_path: Path) -> None:
    # Prepare
    source = tmp_path / "policy_probe_task.py"
    source.write_text(TASK)
    spec = TaskSpec(entry="policy_probe_task:PolicyProbeTask", path=str(tmp_path))

    # Execute
    first = task_digest(spec)
    source.write_text(TASK + "# edited\n")
    edited = task_digest(spec)

    # Assert: the digests of the file's bytes, worked out here
    assert first == hashlib.sha256(TASK.encode()).hexdigest()
    assert edited == hashlib.sha256((TASK + "# edited\n").encode()).hexdigest()


def test_the_built_in_task_is_its_modules_file() -> None:
    import learning.tasks.classification as builtin

    expected = hashlib.sha256(Path(builtin.__file__).read_bytes()).hexdigest()

    assert task_digest(TaskSpec()) == expected


# ------------------------------------------------------------------------------- the round count

class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_count_holds_the_rounds_of_the_last_24_hours(tmp_path: Path) -> None:
    # Prepare: rounds at t = 0, 50,000 and 86,400 s
    clock = Clock(0.0)
    ledger = RoundLedger(tmp_path / "agent" / "policy-rounds.json", clock)
    for t in (0.0, 50_000.0, DAY_S):
        clock.now = t
        ledger.record()

    # Execute: one second later the first is more than a day old
    clock.now = DAY_S + 1
    later = ledger.count()

    # Assert: at 86,400 s the first one (t = 0) is exactly a day old, and out
    assert later == 2
    assert json.loads((tmp_path / "agent" / "policy-rounds.json").read_text()) == {"trained": [50_000.0, DAY_S]}


def test_a_count_nobody_can_read_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "policy-rounds.json"
    path.write_text('{"trained": [1.0, NaN]}')

    with pytest.raises(PolicyError, match=r"policy-rounds.json: not a round count .*; delete it to start counting"):
        RoundLedger(path).count()
