"""Run, round and client statuses are spelled in one place: ``core.status`` (issue 34).

Every other module of the product names them through the enum, so a new
status, or a renamed one, is one edit that mypy and this test follow. A JSON
field or dictionary key that happens to be the same word (``{"running": ...}``
in ``quorum aggregator status --json``) is not a status and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

from core.status import ClientStatus, RoundStatus, RunStatus
from tests.conftest import REPO

PRODUCT = ("core", "runstore", "scenarios", "learning", "privacy", "aggregator", "clients", "runtimes", "deploy",
           "dashboard", "quorum")
#: Run statuses that are no other word Quorum uses ("failed" is also a count's column name).
RUN_ONLY = {s.value for s in RunStatus} - {"failed"}


def _spelled(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    keys = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Dict) for k in node.keys if k is not None}
    keys |= {id(node.slice) for node in ast.walk(tree) if isinstance(node, ast.Subscript)}
    return [f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in RUN_ONLY and id(node) not in keys]


def test_run_statuses_are_spelled_only_in_the_enum() -> None:
    found = [hit for package in PRODUCT for path in sorted((REPO / package).rglob("*.py"))
             if path != REPO / "core" / "status.py" for hit in _spelled(path)]
    assert not found, "spell these through core.status.RunStatus:\n" + "\n".join(found)


def test_the_enums_are_their_stored_strings() -> None:
    # the store, JSON and the pages hold plain strings: a member must equal, format and hash as its value
    assert RunStatus.FINISHED == "finished" and f"{RunStatus.DEGRADED}" == "degraded"
    assert {ClientStatus.OK: 1}["ok"] == 1 and str(ClientStatus.REJECTED) == "rejected"


#: The words a client's or a round's status is spelled with (``ok`` is both).
CLIENT_OR_ROUND = {s.value for s in ClientStatus} | {s.value for s in RoundStatus}
#: Where such a word is a status: a keyword, a variable or an attribute of one of these names.
STATUS_NAMES = {"status", "outcome"}


def _named(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id in STATUS_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in STATUS_NAMES))


def _status_word(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in CLIENT_OR_ROUND


def _spelled_statuses(path: Path, root: Path = REPO) -> list[str]:
    """Client and round statuses given as literals where a status goes: ``outcome="ok"``, ``status == "empty"``,
    ``status = "ok"``, ``x, status = ..., "skipped"``, ``.get("status", "ok")``, and the second place of a
    returned tuple, where the round loop's steps return their status (``return state, "ok" if n else "empty"``)."""
    hits: list[ast.Constant] = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) >= 2:
            second = node.value.elts[1]
            options = [second.body, second.orelse] if isinstance(second, ast.IfExp) else [second]
            hits += [o for o in options if _status_word(o)]  # type: ignore[misc]
        if isinstance(node, ast.keyword) and node.arg in STATUS_NAMES and _status_word(node.value):
            hits.append(node.value)  # type: ignore[arg-type]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_named(s) for s in sides):
                hits += [s for s in sides if _status_word(s)]  # type: ignore[misc]
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if _named(target) and _status_word(node.value):
                    hits.append(node.value)  # type: ignore[arg-type]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    hits += [v for t, v in zip(target.elts, node.value.elts, strict=False)  # type: ignore[misc]
                             if _named(t) and _status_word(v)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
              and node.args[0].value in STATUS_NAMES and _status_word(node.args[1])):
            hits.append(node.args[1])  # type: ignore[arg-type]
    return [f"{path.relative_to(root)}:{n.lineno}: {n.value!r}" for n in hits]


def test_client_and_round_statuses_are_spelled_only_in_their_enums() -> None:
    found = [hit for package in PRODUCT for path in sorted((REPO / package).rglob("*.py"))
             if path != REPO / "core" / "status.py" for hit in _spelled_statuses(path)]
    assert not found, "spell these through core.status.ClientStatus / RoundStatus:\n" + "\n".join(found)


def test_the_status_guard_finds_each_way_of_spelling_one(tmp_path: Path) -> None:
    # Prepare: a module with each form the guard looks for, then the same words where they are no status
    module = tmp_path / "probe.py"
    module.write_text(
        'a = Rec(outcome="dropped")\n'
        'if r.status == "empty":\n    pass\n'
        'status = "ok"\n'
        'x, status = 1, "skipped"\n'
        'y = m.get("status", "ok")\n'
        'def f(n):\n    return n, "ok" if n else "empty"\n'
        'counts = {"dropped": 1, "rejected": 2}\n'  # column names, not statuses
        'z = ("answered", "dropped", "rejected")\n')

    # Execute
    found = _spelled_statuses(module, root=tmp_path)

    # Assert: the seven statuses, by line, and nothing of the last two lines
    assert sorted(int(hit.split(":")[1]) for hit in found) == [1, 2, 4, 5, 6, 8, 8]
