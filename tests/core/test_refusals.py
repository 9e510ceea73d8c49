"""A device's refusal under its site policy on the wire and in the counts: ``refused``, never ``failed`` (issue 48)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from flwr.app import Error
from flwr.common.constant import ErrorCode

from core.outcomes import FAILED, REFUSED, count, edges_line, error_outcome, refusal_summary, round_line, run_problems
from core.replies import REFUSAL_CODE, refusal, refusal_reason
from core.status import ClientStatus


class Result(NamedTuple):
    client: str
    outcome: str
    reason: str | None
    round: int = 1


def test_a_refusal_is_an_error_reply_of_its_own_code_with_the_rule_on_one_line() -> None:
    error = refusal("cohort 3 under\nmin_cohort 5")

    assert (error.code, error.reason) == (4030, "refused by site policy: cohort 3 under min_cohort 5")
    assert refusal_reason(error) == "cohort 3 under min_cohort 5"
    assert error_outcome(error) == (REFUSED, "cohort 3 under min_cohort 5") and REFUSED == ClientStatus.REFUSED


@pytest.mark.parametrize("code", [c for c in vars(ErrorCode).values() if isinstance(c, int)])
def test_no_flower_error_is_a_refusal_whatever_it_says(code: int) -> None:
    error = Error(code=code, reason="refused by site policy: secure aggregation required")

    assert code != REFUSAL_CODE and refusal_reason(error) is None and error_outcome(error)[0] != REFUSED


def test_the_round_line_groups_refusals_by_rule() -> None:
    # Prepare: six sampled, two answered, one failed, three refused by two rules
    results = [Result("1", "refused", "secure aggregation required"), Result("2", "ok", None),
               Result("3", "refused", "cohort 6 under min_cohort 10"), Result("4", "ok", None),
               Result("5", "refused", "secure aggregation required"), Result("6", "failed", "DataError: bad")]

    # Execute
    line = round_line(6, count(results, {"5": "dev5"}))

    # Assert: the larger group first, the device's name where known
    assert line == ("2/6 answered, 3 refused (policy: secure aggregation required [client 1, dev5]; "
                    "cohort 6 under min_cohort 10 [client 3]), 1 failed: client 6 DataError: bad")


def test_the_run_names_its_refusing_sites_first_and_not_as_never_contributing() -> None:
    # Prepare: two rounds; dev-a refused both, dev-b refused once then trained, dev-c failed once
    results = [Result("a", "refused", "secure aggregation required", 1), Result("a", "refused",
               "secure aggregation required", 2), Result("b", "refused", "no client-level DP (max_epsilon = 8)", 1),
               Result("b", "ok", None, 2), Result("c", "ok", None, 1), Result("c", "failed", "boom", 2)]
    names = {"a": "dev-a", "b": "dev-b", "c": "dev-c"}

    # Execute
    said = refusal_summary(results, names)
    problems = run_problems(results, names)

    # Assert
    assert said == ("2 of 3 sites refused: no client-level DP (max_epsilon = 8) (dev-b); "
                    "secure aggregation required (dev-a)")
    assert problems == [said, "dev-c failed in 1 of 2 rounds (boom)"]
    assert refusal_summary([Result("a", "ok", None)]) is None and FAILED not in said


def test_many_distinct_reasons_are_cut_to_a_few_in_the_line_and_the_run() -> None:
    # Prepare: 10 sites refusing, each with its own (client-chosen) reason of 400 characters
    results = [Result(str(n), "refused", f"{n}" + "x" * 400) for n in range(10)]

    # Execute
    line = round_line(10, count(results))
    said = refusal_summary(results)

    # Assert: two reasons in a round's line, three in the run's, of at most 300 characters each, then how many more
    assert line.endswith("; 8 more rules)") and line.count("[client ") == 2 and len(line) < 1000
    assert said is not None and said.startswith("10 of 10 sites refused: ")
    assert said.endswith("; and 7 more rules") and len(said) < 1000


def test_a_tree_round_line_counts_its_edges_and_names_a_lost_one() -> None:
    assert edges_line(None) == ""
    assert edges_line({"edges": [{"edge": 0}, {"edge": 1}, {"edge": 2}]}) == " via 3 edges"
    assert edges_line({"edges": [{"edge": 0}]}) == " via 1 edge"
    lost = {"edges": [{"edge": 0}, {"edge": 1, "problem": "edge 1's partial sum refused: weight 10\nis not 1"}]}
    assert edges_line(lost) == " via 2 edges (1 lost: edge 1's partial sum refused: weight 10 is not 1)"
    assert edges_line({"edges": "junk"}) == ""
