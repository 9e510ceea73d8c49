"""The suite's one polling helper (it returns what came true, and a timeout fails by name), and the guard
that no test waits with a fixed sleep instead."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_for


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


#: The only ``time.sleep`` calls the suite may hold: each is the behaviour under test (a client that is slow
#: on purpose), never a wait for something to happen. A new one needs a reason here.
SIMULATED_DELAYS = {
    ("tests/conftest.py", "wait_for"): "the polling helper itself: it sleeps between polls, up to its deadline",
    ("tests/runtimes/slow_app/slow_client.py", "slow_device"): "a SuperNode whose node config asks it to be slow",
    ("tests/runtimes/test_pool.py", "answer"): "a ClientApp handler that is slow on purpose (reply order)",
    ("tests/aggregator/test_eval_rejection.py", "silent_after_training"):
        "a client whose evaluation reply comes after the round's deadline (a device killed between its replies)",
}


def _sleeps(path: Path) -> list[tuple[str, int]]:
    """``(enclosing function, line)`` of every call to ``time.sleep`` or a bare ``sleep`` imported from time."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call) and _is_sleep(child.func):
                found.append((function, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def _is_sleep(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        return func.attr == "sleep" and isinstance(func.value, ast.Name) and func.value.id == "time"
    return isinstance(func, ast.Name) and func.id == "sleep"


def test_no_test_waits_with_a_fixed_sleep() -> None:
    # Prepare: every Python file of the suite (code inside strings, e.g. a child process's script, is not a call)
    root = REPO / "tests"

    # Execute
    calls = {(str(path.relative_to(REPO)), function): line
             for path in sorted(root.rglob("*.py")) for function, line in _sleeps(path)}

    # Assert: waits go through wait_for, which returns as soon as the condition holds
    unexplained = {f"{path}:{line} in {function}()" for (path, function), line in calls.items()
                   if (path, function) not in SIMULATED_DELAYS}
    assert not unexplained, f"fixed sleeps (wait with tests.conftest.wait_for instead): {sorted(unexplained)}"


def test_the_sleep_scanner_finds_a_poll_loop(tmp_path: Path) -> None:
    # Prepare: the shapes a fixed wait takes
    source = tmp_path / "t.py"
    source.write_text("import time\nfrom time import sleep\n\ndef test_x():\n    while True:\n"
                      "        time.sleep(0.2)\n\ndef helper():\n    sleep(1)\n    other.sleep(1)\n")

    # Execute / Assert: both sleeps, not a method that happens to be called sleep
    assert _sleeps(source) == [("test_x", 6), ("helper", 9)]
