"""Run ids on the command line: the exact id or a unique prefix, compared literally (issue 32).

``quorum resume 20261202-1`` used to say "no run" when two runs started so,
and ``%`` / ``_`` acted as SQL wildcards. Every command that takes a run id
goes through :meth:`runstore.store.RunStore.get_run`.
"""

from __future__ import annotations

import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from core.errors import RunNotFound
from quorum.cli import app
from runstore.store import Run, RunStore

FIRST, SECOND, OTHER = "20261202-101500-a1b2c3", "20261202-113000-d4e5f6", "20261203-090000-abcdef"


def store_with(db_url: str, *ids: str) -> RunStore:
    """A store holding one (empty) run under each of ``ids``."""
    store = RunStore(db_url)
    for wanted in ids:
        made = store.create_run(name=wanted, scenario={}, seed=0, strategy="fedavg", rounds=1)
        with store.session() as s, s.begin():
            s.execute(update(Run).where(Run.id == made).values(id=wanted))
    return store


def test_the_exact_id_and_a_unique_prefix_name_the_run(db_url: str) -> None:
    store = store_with(db_url, FIRST, SECOND, OTHER)
    assert store.get_run(FIRST).id == FIRST
    assert store.get_run("20261202-10").id == FIRST
    assert store.get_run("20261203").id == OTHER


def test_the_random_tail_of_an_id_still_names_the_run(db_url: str) -> None:
    store = store_with(db_url, FIRST, SECOND)
    assert store.get_run("d4e5f6").id == SECOND


def test_an_ambiguous_prefix_says_how_many_runs_start_with_it(db_url: str) -> None:
    store = store_with(db_url, FIRST, SECOND, OTHER)
    with pytest.raises(RunNotFound, match=r"^ambiguous: 2 runs start with '20261202-1' in .*"
                                          rf"\({FIRST}, {SECOND}\); give more of the id$"):
        store.get_run("20261202-1")


@pytest.mark.parametrize("text", ["%", "2026%", "20261202-10150_", "_0261203", "%abcdef", "ABCDEF", ""])
def test_sql_wildcards_and_case_do_not_match(db_url: str, text: str) -> None:
    store = store_with(db_url, FIRST, OTHER)
    with pytest.raises(RunNotFound, match=r"^no run "):
        store.get_run(text)


def test_a_substring_from_the_middle_is_no_run_id(db_url: str) -> None:
    store = store_with(db_url, FIRST)
    with pytest.raises(RunNotFound, match="no run '101500'"):
        store.get_run("101500")


@pytest.mark.parametrize("command", [["resume"], ["report"], ["export", "--out", "OUT"]],
                         ids=["resume", "report", "export"])
def test_every_command_that_takes_a_run_id_reports_an_ambiguous_prefix(db_url: str, tmp_path, command) -> None:
    store_with(db_url, FIRST, SECOND)
    args = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    result = CliRunner().invoke(app, [args[0], "20261202-1", *args[1:], "--db", db_url])
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert "ambiguous: 2 runs start with '20261202-1'" in result.stderr


@pytest.mark.parametrize("command", ["resume", "report"])
def test_a_wildcard_on_the_command_line_is_no_run(db_url: str, command: str) -> None:
    store_with(db_url, FIRST)
    result = CliRunner().invoke(app, [command, "2026%", "--db", db_url])
    assert result.exit_code == 2 and "no run '2026%'" in result.stderr
