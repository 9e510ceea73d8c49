"""The layering rules that the import contract alone does not check."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("core", "scenarios", "learning", "privacy", "aggregator", "clients", "runtimes", "deploy",
               "dashboard", "quorum")


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, column) for every import statement in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.col_offset) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.col_offset))
    return found


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def test_every_lazy_first_party_import_is_declared_with_a_reason() -> None:
    # Prepare: the declarations in pyproject.toml
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["quorum"]["lazy-imports"]

    # Execute: modules that import a first-party module inside a function
    lazy = {_module(path) for package in FIRST_PARTY for path in (REPO / package).rglob("*.py")
            if any(col > 0 and name.split(".")[0] in FIRST_PARTY for name, col in _imports(path))}

    # Assert: declared exactly (an undeclared one hides a dependency, a stale one misleads)
    assert lazy - set(declared) == set(), "undeclared lazy imports"
    assert set(declared) - lazy == set(), "declared but no longer lazy"
    assert all(len(reason) > 20 for reason in declared.values())


def test_nothing_under_tests_imports_from_bench() -> None:
    # Execute
    offenders = [str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("*.py")
                 if any(name == "bench" or name.startswith("bench.") for name, _ in _imports(path))]

    # Assert: benchmarks run as subprocesses only
    assert offenders == []


def test_every_product_module_is_named_in_docs_architecture() -> None:
    # docs/architecture.md's "Every module" index lists each module by its path: a new one must be added there
    page = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [path.relative_to(REPO).as_posix() for package in ("runstore", *FIRST_PARTY)
               for path in sorted((REPO / package).rglob("*.py"))
               if path != REPO / package / "__init__.py" and f"`{path.relative_to(REPO).as_posix()}`" not in page]
    assert not missing, "add these to docs/architecture.md's module index:\n" + "\n".join(missing)
