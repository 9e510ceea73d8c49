"""What the commands print is printed as it is: square brackets in a message, a path or a help text survive.

rich reads ``[word]`` as markup and drops it; every console of a command is
made with ``markup=False`` (styles come from ``rich.text.Text``), and help
texts, which typer renders as rich markup, escape their brackets.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from quorum.cli import app
from tests.quorum.test_cli import assert_clean_exit_2, cli

#: A message as a user's own paths, values and our own table names may make it: each bracket must survive.
BRACKETS = "in [strategy.fedadam], beta1; set it under [dp]; path /tmp/[x]/a.csv; [bold]not bold[/bold] [/] ["


def _failers() -> Iterator[tuple[str, Callable[[str], None]]]:
    from dashboard import cli as dashboard_cli
    from deploy import agent_cli
    from deploy import cli as deploy_cli
    from quorum import cli as quorum_cli
    from quorum import flower as flower_cli

    for module in (quorum_cli, flower_cli, deploy_cli, agent_cli, dashboard_cli):
        yield module.__name__, module._fail


@pytest.mark.parametrize(("name", "fail"), list(_failers()), ids=[n for n, _ in _failers()])
def test_every_commands_error_line_keeps_its_brackets(name: str, fail: Callable[[str], None],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Execute
    with pytest.raises(typer.Exit) as exited:
        fail(BRACKETS)

    # Assert: one line, exit 2, the message word for word after "error: "
    err = capsys.readouterr().err
    assert exited.value.exit_code == 2
    assert err == f"error: {BRACKETS}\n", (name, err)


def test_the_dp_planners_error_keeps_its_brackets(capsys: pytest.CaptureFixture[str]) -> None:
    from privacy.dp import cli as dp_cli
    from privacy.dp.errors import DPConfigError

    def refuse() -> float:
        raise DPConfigError("dp.clip_norm", "[1]", BRACKETS)

    with pytest.raises(typer.Exit):
        dp_cli._or_exit(refuse)
    err = capsys.readouterr().err
    assert err.startswith("error: dp.clip_norm") and f"{BRACKETS}\n" in err and "[1]" in err, err


def test_a_scenario_error_naming_a_strategy_table_reaches_the_terminal_whole(tmp_path: Path) -> None:
    # Prepare: FedProx's key under FedAdam, which the message answers with FedAdam's own table's keys
    bad = tmp_path / "bad[1].toml"
    bad.write_text('rounds = 1\n[strategy]\nname = "fedadam"\nmu = 0.8\n')

    # Execute
    out = cli("simulate", str(bad), "--db", f"sqlite:///{tmp_path / 'r.db'}", check=False)

    # Assert: the file name and the table name, brackets and all
    assert_clean_exit_2(out)
    assert str(bad) in out.stderr and "in [strategy.fedadam], " in out.stderr, out.stderr


def test_runs_table_shows_a_scenario_name_with_brackets(tmp_path: Path) -> None:
    # Prepare: a finished run whose scenario is named with brackets
    from tests.quorum.test_cli import TINY

    scenario = tmp_path / "s.toml"
    scenario.write_text(TINY.replace('name = "cli-tiny"', 'name = "tiny[v2]"'))
    db = f"sqlite:///{tmp_path / 'r.db'}"
    cli("simulate", str(scenario), "--db", db, "--json", "--rounds", "1")

    # Execute
    out = cli("runs", "--db", db)

    # Assert
    assert "tiny[v2]" in out.stdout, out.stdout


def _help_texts(command: click.Command, path: str) -> Iterator[tuple[str, str]]:
    yield path, command.help or ""
    for param in command.params:
        yield f"{path} {param.name}", getattr(param, "help", None) or ""
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _help_texts(sub, f"{path} {name}")


def test_no_help_text_holds_a_bracket_that_rich_would_read_as_markup() -> None:
    # typer renders help as rich markup: a bracket must be written "\\[" to be shown
    command = typer.main.get_command(app)
    raw = [(where, text) for where, text in _help_texts(command, "quorum") if re.search(r"(?<!\\)\[", text)]
    assert raw == []


@pytest.mark.parametrize(("args", "shown"), [
    (["simulate", "--help"], "quorum[simulation]"),
    (["resume", "--help"], "--round N [SCENARIO]"),
    (["parallel", "--help"], "[compression]"),
])
def test_help_shows_the_brackets_it_names(args: list[str], shown: str) -> None:
    out = CliRunner().invoke(app, args, terminal_width=200)
    assert out.exit_code == 0
    assert shown in out.stdout, out.stdout
