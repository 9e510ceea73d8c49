"""``quorum audit``: the audit trail of the run store, newest rows first, or checked end to end (``--verify``).

The trail lives in the run store (``runstore/audit.py``): logins, submissions,
stops, downloads, account changes and policy refusals, each row chained to
the one before it by its SHA-256. ``--verify`` recomputes every digest and
link and names the first row that does not match; publish the head it prints
somewhere the database's writers cannot reach, so that a trail cut short or
rewritten from some row on shows as well.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from core.errors import QuorumError
from runstore.store_url import default_db_url

if TYPE_CHECKING:
    from runstore.audit import AuditRow, Verification
    from runstore.store import RunStore

__all__ = ["audit_command"]


def _out() -> Console:
    """Return a console for the command's output, made when it prints (its width: the terminal's or $COLUMNS)."""
    return Console(markup=False, highlight=False, soft_wrap=True)  # names, targets and details as written


def _fail(message: str, code: int = 2) -> NoReturn:
    err = Console(stderr=True, markup=False, highlight=False)
    err.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)  # one line, unwrapped
    raise typer.Exit(code)


def _open(db: str) -> RunStore:
    """Open the store at ``db``, or exit 2 with the one line that names it and the fix (``runstore/opening.py``)."""
    from runstore.store import RunStore

    try:
        return RunStore(db)
    except QuorumError as exc:
        _fail(str(exc))


def audit_command(
    db: Annotated[str, typer.Option("--db", help="Run store: an SQLAlchemy URL.", envvar="QUORUM_DB")]
    = default_db_url(),
    verify: Annotated[bool, typer.Option(
        "--verify", help="Check every row's digest and its link to the row before; exit 1 naming the first row "
                         "that does not match, 0 with the head (id and digest) to publish.")] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, help="How many of the newest rows to list.")] = 50,
    action: Annotated[str | None, typer.Option(
        "--action", help="List only this action's rows (login, login_failed, submit, stop, download_model, ...).")]
    = None,
    actor: Annotated[str | None, typer.Option("--actor", help="List only the rows of this actor.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object: the rows listed, or what --verify found.")] = False,
) -> None:
    """Show the audit trail (who logged in, submitted, stopped, downloaded, changed accounts), newest first.

    With --verify, check that no row was changed, deleted or inserted:
    exit 0 with the trail's head (publish it), 1 naming the first row that
    does not match. Rows cut off the end, or a trail rewritten by someone
    with write access to the database, show only against a head published
    earlier (docs/security.md).
    """
    from runstore.audit import AuditError, rows
    from runstore.audit import verify as verify_trail

    store = _open(db)
    try:
        if verify:
            _print_verification(verify_trail(store), json_out)
        listed = rows(store, limit=limit, action=action, actor=actor)
    except AuditError as exc:
        _fail(str(exc))
    finally:
        store.close()
    if json_out:
        sys.stdout.write(json.dumps({"rows": [asdict(row) for row in listed]}) + "\n")
    else:
        _print_table(listed, db)


def _print_verification(found: Verification, json_out: bool) -> NoReturn:
    code = 0 if found.ok else 1
    if json_out:
        sys.stdout.write(json.dumps({"ok": found.ok, "checked": found.rows, "first_bad": found.first_bad,
                                     "reason": found.reason or None,
                                     "head": None if found.head is None else {"id": found.head[0],
                                                                              "digest": found.head[1]},
                                     "exit_code": code}) + "\n")
    elif found.ok:
        _out().print(found.message)
    else:
        _out().print(f"audit trail broken at {found.message}")
    raise typer.Exit(code)


def _print_table(listed: list[AuditRow], db: str) -> None:
    table = Table(title=f"audit trail in {db}, newest first")
    for col in ("id", "time (UTC)", "actor", "org", "action", "target", "detail"):
        table.add_column(col, overflow="fold")
    for row in listed:
        table.add_row(str(row.id), _when(row.at), row.actor, row.org, row.action, row.target,
                      json.dumps(row.detail, sort_keys=True) if row.detail else "")
    out = _out()
    out.print(table)
    if not listed:
        out.print("nothing recorded yet")


def _when(at: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
    except (ValueError, OverflowError, OSError):  # a time no clock gave: the row was tampered with (--verify)
        return repr(at)
