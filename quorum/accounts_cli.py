"""``quorum accounts``: who may use the dashboard and its API, with which role, for which organisation.

Accounts and their API tokens live in the run store (``runstore/accounts.py``),
so an aggregator, its standby and its dashboard share them. A token is shown
once, when it is issued; the store keeps only its SHA-256. Every change is
appended to the audit trail (``quorum audit``) as done by ``cli:USER``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from runstore.store_url import default_db_url

__all__ = ["accounts_app"]

accounts_app = typer.Typer(no_args_is_help=True, add_completion=False,
                           help="Accounts and API tokens for the dashboard (roles: admin, lead, member, service).")
console = Console(markup=False, highlight=False)

DbOption = Annotated[str, typer.Option("--db", help="Run store: an SQLAlchemy URL.", envvar="QUORUM_DB")]
DEFAULT_DB = default_db_url()  # runs/quorum.db under the working directory
DaysOption = Annotated[float, typer.Option(
    "--days", help="How long the token is valid, in days (at most 3650).")]


def _fail(message: str) -> NoReturn:
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(2)


def _open(db: str):  # type: ignore[no-untyped-def]  # a RunStore; imported when a command runs
    from core.errors import StoreError
    from runstore.store import RunStore

    try:
        return RunStore(db)
    except StoreError as exc:
        _fail(str(exc))


def _audit(store: object, action: str, target: str, org: str = "", **detail: object) -> None:
    """Append who did this (``cli:USER``) to the store's audit trail (``runstore/audit.py``)."""
    import getpass

    from runstore.audit import append

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = str(os.getuid())
    append(store, f"cli:{user}"[:64], action, target=target, org=org, detail=detail)  # type: ignore[arg-type]


def _token_note(token: str, days: float) -> None:
    console.print(f"token (shown once; valid {days:g} days): {token}", soft_wrap=True)
    console.print("use it as `Authorization: Bearer TOKEN`, or open the dashboard at /?token=TOKEN once")


@accounts_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="The account's name (letters, digits, . _ @ -).")],
    org: Annotated[str, typer.Option("--org", help="Its organisation: the site whose devices it may see.")],
    role: Annotated[str, typer.Option(
        "--role", help="admin: everything; lead: submits, stops, resumes, downloads its own runs' models; "
                       "member: views, its organisation's clients only; service: /metrics only.")] = "member",
    days: DaysOption = 90.0,
    token: Annotated[bool, typer.Option("--token/--no-token", help="Issue a first API token now.")] = True,
    oidc_issuer: Annotated[str | None, typer.Option(
        "--oidc-issuer", help="Link the account to an identity at this OpenID provider (its issuer URL, as given "
                              "to `quorum dashboard --oidc-issuer`): it then logs in there.")] = None,
    oidc_subject: Annotated[str | None, typer.Option(
        "--oidc-subject", help="The identity's subject: the `sub` claim the provider puts in its ID tokens (the "
                               "dashboard's refusal page shows it).")] = None,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Add an account (and issue its first API token, shown once)."""
    from runstore.accounts import AccountError, add_account, check_days, issue_token
    from runstore.audit import ACCOUNT_ADD, TOKEN_ISSUE

    store = _open(db)
    try:
        if token:
            check_days(days)  # before the account exists: a bad lifetime adds nothing
        account = add_account(store, name, org, role, issuer=oidc_issuer, subject=oidc_subject)
        linked = {"oidc_issuer": oidc_issuer, "oidc_subject": oidc_subject} if oidc_issuer else {}
        _audit(store, ACCOUNT_ADD, name, org, role=role, **linked)
        console.print(f"account {account.name}: {account.role} of {account.org}"
                      + (f", logs in at {oidc_issuer} as {oidc_subject}" if oidc_issuer else ""))
        if token:
            issued = issue_token(store, name, days)
            _audit(store, TOKEN_ISSUE, name, org, shown=issued[:12], days=days)
            _token_note(issued, days)
    except AccountError as exc:
        _fail(str(exc))


@accounts_app.command("token")
def token_command(
    name: Annotated[str, typer.Argument(help="The account to issue a token for.")],
    days: DaysOption = 90.0,
    db: DbOption = DEFAULT_DB,
) -> None:
    """Issue another API token for an account (shown once)."""
    from runstore.accounts import AccountError, issue_token
    from runstore.audit import TOKEN_ISSUE

    store = _open(db)
    try:
        issued = issue_token(store, name, days)
        _audit(store, TOKEN_ISSUE, name, shown=issued[:12], days=days)
        _token_note(issued, days)
    except AccountError as exc:
        _fail(str(exc))


@accounts_app.command("list")
def list_command(
    db: DbOption = DEFAULT_DB,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per account, one per line.")] = False,
) -> None:
    """List the accounts, their roles and tokens (the first characters of each; never the secret)."""
    from runstore.accounts import list_accounts

    now = time.time()
    rows = list_accounts(_open(db))

    def state(revoked: float | None, expires: float | None = None) -> str:
        if revoked is not None:
            return "revoked"
        return "expired" if expires is not None and expires <= now else "live"

    if json_out:
        for account, tokens in rows:
            print(json.dumps({"name": account.name, "org": account.org, "role": account.role,
                              "status": state(account.revoked_at), "oidc_issuer": account.issuer,
                              "oidc_subject": account.subject,
                              "tokens": [{"shown": t.shown, "status": state(t.revoked_at, t.expires_at),
                                          "expires_at": t.expires_at} for t in tokens]}))
        return
    table = Table(title=f"accounts in {db}")
    for col in ("account", "org", "role", "status", "tokens"):
        table.add_column(col)
    for account, tokens in rows:
        shown = ", ".join(f"{t.shown}… ({state(t.revoked_at, t.expires_at)}, until "
                          f"{time.strftime('%Y-%m-%d', time.gmtime(t.expires_at))})" for t in tokens)
        table.add_row(account.name, account.org, account.role, state(account.revoked_at), shown or "none")
    console.print(table)


@accounts_app.command("revoke")
def revoke(
    name: Annotated[str, typer.Argument(help="The account to revoke, with all its tokens.")],
    db: DbOption = DEFAULT_DB,
) -> None:
    """Revoke an account and every token it has (its requests get 401 from then on)."""
    from runstore.accounts import AccountError, revoke_account
    from runstore.audit import ACCOUNT_REVOKE

    store = _open(db)
    try:
        live = revoke_account(store, name)
    except AccountError as exc:
        _fail(str(exc))
    _audit(store, ACCOUNT_REVOKE, name, tokens=live)
    console.print(f"account {name} revoked ({live} live token(s) with it)")


@accounts_app.command("revoke-token")
def revoke_token_command(
    token: Annotated[str, typer.Argument(help="The token, or its first 8-12 characters as `list` shows them.")],
    db: DbOption = DEFAULT_DB,
) -> None:
    """Revoke one API token."""
    from runstore.accounts import AccountError, revoke_token
    from runstore.audit import TOKEN_REVOKE

    store = _open(db)
    try:
        owner = revoke_token(store, token)
    except AccountError as exc:
        _fail(str(exc))
    _audit(store, TOKEN_REVOKE, owner, shown=token[:12])
    console.print(f"token {token[:12]}… of {owner} revoked")
