"""``quorum accounts``: accounts, roles and API tokens in the run store (issue #48)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from quorum.cli import app
from runstore.accounts import AccountError, add_account, authenticate, list_accounts, token_digest
from runstore.store import RunStore


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["accounts", *args])
    return result.exit_code, result.output


def test_add_list_and_revoke_from_the_command_line(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'q.db'}"
    code, out = _run("add", "ana", "--org", "north", "--role", "lead", "--days", "2", "--db", db)
    assert code == 0, out
    token = re.search(r"qrm_[A-Za-z0-9_-]{43}", out.replace("\n", ""))
    assert token is not None
    store = RunStore(db)
    who = authenticate(store, token.group(0))
    assert who is not None and (who.name, who.org, who.role) == ("ana", "north", "lead")
    # the store keeps the token's SHA-256 and its first 12 characters, never the token
    ((account, tokens),) = list_accounts(store)
    assert [t.digest for t in tokens] == [token_digest(token.group(0))] and tokens[0].shown == token.group(0)[:12]
    assert token.group(0) not in Path(tmp_path / "q.db").read_bytes().decode("latin-1")

    code, out = _run("list", "--db", db, "--json")
    listed = json.loads(out.splitlines()[0])
    assert code == 0 and (listed["role"], listed["status"], listed["tokens"][0]["status"]) == ("lead", "live", "live")
    assert token.group(0) not in out

    assert _run("revoke", "ana", "--db", db)[0] == 0
    assert authenticate(store, token.group(0)) is None
    assert json.loads(_run("list", "--db", db, "--json")[1].splitlines()[0])["tokens"][0]["status"] == "revoked"


@pytest.mark.parametrize(("args", "message"), [
    (["add", "ana", "--org", "north", "--role", "root"], "role 'root': one of admin, lead, member, service"),
    (["add", "a b", "--org", "north"], "account 'a b': 1-64 characters"),
    (["add", "ana", "--org", ""], "organisation '': 1-64 characters"),
    (["add", "ana", "--org", "north", "--days", "nan"], "token lifetime nan days"),
    (["add", "ana", "--org", "north", "--days", "0"], "token lifetime 0.0 days"),
    (["add", "ana", "--org", "north", "--days", "1e308"], "token lifetime 1e+308 days"),
    (["revoke", "nobody"], "no account 'nobody'"),
    (["token", "nobody"], "no account 'nobody'"),
    (["revoke-token", "qrm_"], "give at least its first 8 characters"),
], ids=["role", "name", "org", "nan-days", "zero-days", "huge-days", "revoke-unknown", "token-unknown", "short"])
def test_bad_input_is_one_line_naming_it_and_adds_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    db = f"sqlite:///{tmp_path / 'q.db'}"
    code, out = _run(*args, "--db", db)
    assert code == 2 and message in " ".join(out.split()), out
    assert list_accounts(RunStore(db)) == []


def test_a_second_account_of_the_same_name_is_refused(tmp_path: Path) -> None:
    store = RunStore(f"sqlite:///{tmp_path / 'q.db'}")
    add_account(store, "ana", "north", "member")
    with pytest.raises(AccountError, match="exists already"):
        add_account(store, "ana", "south", "admin")
    assert [(a.org, a.role) for a, _ in list_accounts(store)] == [("north", "member")]


@settings(max_examples=80, deadline=None)
@given(token=st.one_of(st.text(max_size=100), st.text(min_size=47, max_size=47).map(lambda t: "qrm_" + t[4:]),
                       st.binary(max_size=64).map(lambda b: b.decode("latin-1"))))
def test_anything_but_an_issued_token_authenticates_no_one(tmp_path_factory: pytest.TempPathFactory,
                                                          token: str) -> None:
    store = RunStore(f"sqlite:///{tmp_path_factory.getbasetemp() / 'hyp.db'}")
    if not list_accounts(store):
        add_account(store, "ana", "north", "admin")
    assert authenticate(store, token) is None
    assert authenticate(store, token + "\n") is None


def test_every_account_change_is_in_the_audit_trail_and_no_token_is(tmp_path: Path) -> None:
    from runstore.audit import rows, verify

    db = f"sqlite:///{tmp_path / 'q.db'}"
    out = _run("add", "ana", "--org", "north", "--role", "member", "--db", db)[1]
    token = re.search(r"qrm_[A-Za-z0-9_-]{43}", out.replace("\n", ""))
    assert token is not None
    _run("token", "ana", "--days", "3", "--db", db)
    _run("revoke-token", token.group(0)[:12], "--db", db)
    _run("revoke", "ana", "--db", db)
    _run("revoke", "nobody", "--db", db)  # refused: nothing recorded

    store = RunStore(db)
    trail = list(reversed(rows(store, limit=100)))
    assert [(r.action, r.target) for r in trail] == [("account_add", "ana"), ("token_issue", "ana"),
                                                     ("token_issue", "ana"), ("token_revoke", "ana"),
                                                     ("account_revoke", "ana")]
    assert all(r.actor.startswith("cli:") for r in trail)
    assert trail[0].detail == {"role": "member"} and trail[-1].detail == {"tokens": 1}
    assert token.group(0) not in repr([r.detail for r in trail]) and verify(store).ok
