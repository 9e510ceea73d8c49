"""The suite's one polling helper: it returns what came true, and a timeout fails by name."""

from __future__ import annotations

import pytest

from tests.conftest import wait_for


def test_wait_for_returns_the_first_truthy_value() -> None:
    polls = iter([None, [], [3]])

    assert wait_for(lambda: next(polls), 5, "the third poll", poll_s=0.0) == [3]


def test_wait_for_fails_naming_what_it_waited_for() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"timed out after 0.05 s waiting for the flag\nlogs"):
        wait_for(lambda: False, 0.05, lambda: "the flag\nlogs", poll_s=0.01)


def test_wait_for_asks_once_more_at_the_deadline() -> None:
    polls: list[int] = []

    def second_time() -> bool:
        polls.append(1)
        return len(polls) >= 2

    assert wait_for(second_time, 0.01, "the second poll", poll_s=10.0)
