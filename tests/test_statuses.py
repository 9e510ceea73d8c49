"""A run's statuses are spelled in one place: ``core.status.RunStatus`` (issue 34).

Every other module of the product names them through the enum, so a new
status, or a renamed one, is one edit that mypy and this test follow. A JSON
field or dictionary key that happens to be the same word (``{"running": ...}``
in ``quorum aggregator status --json``) is not a status and is not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

from core.status import ClientStatus, RunStatus
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
