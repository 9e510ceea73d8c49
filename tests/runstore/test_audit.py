"""The audit trail (``runstore/audit.py``): a hash chain that names the first row someone changed.

Every tamper is done the way an intruder with the database would do it: raw
SQL on the SQLite file (``sqlite3``), never through the model. The digests the
tests expect are written out by hand from the encoding the module documents.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from typer.testing import CliRunner

from runstore import audit
from runstore.audit import GENESIS, AuditError, append, head, rows, verify
from runstore.store import RunStore
from tests.conftest import REPO
from tests.postgres_server import postgres_server

CONTENT = "its content does not match its digest"
LINK = "links to a row that is not the one before it"
T0 = 1_700_000_000.25  # the first row's time; each append is 0.5 s later (Clock)


class Clock:
    """A store's clock that reads T0, T0 + 0.5, T0 + 1.0, ...: times whose digests can be worked out by hand."""

    def __init__(self) -> None:
        self.now = T0 - 0.5

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


def _url(path: Path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "quorum.db"


@pytest.fixture
def store(db: Path) -> RunStore:
    return RunStore(_url(db), clock=Clock())


def _five(store: RunStore) -> list[audit.AuditRow]:
    """Rows 1-5: alice submits run-1..run-5, each with ``{"n": i}``."""
    return [append(store, "alice", audit.SUBMIT, target=f"run-{i}", org="h1", detail={"n": i}) for i in range(1, 6)]


def _sql(db: Path, statement: str, *args: object) -> None:
    with sqlite3.connect(db) as connection:
        connection.execute(statement, args)
    connection.close()


def _column(db: Path, column: str, row_id: int) -> Any:
    with sqlite3.connect(db) as connection:
        value = connection.execute(f"SELECT {column} FROM audit_log WHERE id = ?", (row_id,)).fetchone()[0]
    connection.close()
    return value


def _one_char_changed(value: str, at: int) -> str:
    """``value`` with the character at ``at`` replaced by another of the same kind (hex stays hex)."""
    old = value[at]
    new = "1" if old == "0" else "0" if old.isdigit() or old in "abcdef" else "x" if old != "x" else "y"
    return value[:at] + new + value[at + 1:]


def test_a_chain_of_rows_verifies_and_links_each_row_to_the_one_before(store: RunStore) -> None:
    # Execute
    written = _five(store)
    found = verify(store)

    # Assert: ids 1..5, each prev the digest before it (64 zeros for the first), the head the newest row
    assert [r.id for r in written] == [1, 2, 3, 4, 5]
    assert [r.prev for r in written] == [GENESIS] + [r.digest for r in written[:-1]]
    assert [r.at for r in written] == [T0, T0 + 0.5, T0 + 1.0, T0 + 1.5, T0 + 2.0]
    assert found == audit.Verification(ok=True, rows=5, head=(5, written[-1].digest))
    assert found.message == f"audit trail intact: 5 rows, head 5 {written[-1].digest[:16]}"
    assert head(store) == (5, written[-1].digest)


def test_an_empty_trail_is_intact_and_has_no_head(store: RunStore) -> None:
    assert verify(store) == audit.Verification(ok=True, rows=0)
    assert head(store) is None and rows(store) == []


def test_a_digest_is_the_sha256_of_the_documented_encoding_written_out_by_hand(store: RunStore, db: Path) -> None:
    # Prepare: the encoding of row 1, by hand: a JSON array, keys sorted, no spaces, non-ASCII escaped, the time
    # as repr writes it
    detail = {"b": 1, "a": [1.5, "\u00e9", None, True]}
    expected = (b'[1,1700000000.25,"alice","h1","download_model","run-\\u00e9",'
                b'{"a":[1.5,"\\u00e9",null,true],"b":1},"' + b"0" * 64 + b'"]')

    # Execute
    row = append(store, "alice", audit.DOWNLOAD_MODEL, target="run-\u00e9", org="h1", detail=detail)

    # Assert: the stored digest (read by raw SQL) is the SHA-256 of those bytes, and so is the next row's prev
    assert _column(db, "digest", 1) == row.digest == hashlib.sha256(expected).hexdigest()
    assert audit.canonical(1, T0, "alice", "h1", "download_model", "run-\u00e9", detail, GENESIS) == expected
    assert append(store, "bob", audit.LOGIN).prev == row.digest


#: One character changed in each column that the digest covers, as raw SQL would: (column, change of the old value)
TAMPERS: dict[str, Callable[[Any], Any]] = {
    "at": lambda old: old + 0.001,                                # 1700000001.25 -> 1700000001.251
    "actor": lambda old: _one_char_changed(old, 0),               # alice -> 0lice
    "org": lambda old: _one_char_changed(old, 1),                 # h1 -> h0
    "action": lambda old: _one_char_changed(old, 2),              # submit -> su0mit
    "target": lambda old: _one_char_changed(old, len(old) - 1),   # run-3 -> run-0 (run-0 -> run-1)
    "detail": lambda old: old.replace('"n"', '"m"'),              # {"n": 3} -> {"m": 3}
    "prev": lambda old: _one_char_changed(old, 63),
    "digest": lambda old: _one_char_changed(old, 0),
}


@pytest.mark.parametrize("row_id", [1, 3, 5], ids=["first", "middle", "newest"])
@pytest.mark.parametrize("column", sorted(TAMPERS))
def test_one_changed_character_in_any_column_of_any_row_names_that_row(
        store: RunStore, db: Path, column: str, row_id: int) -> None:
    # Prepare
    _five(store)
    old = _column(db, column, row_id)
    new = TAMPERS[column](old)
    assert new != old

    # Execute
    _sql(db, f"UPDATE audit_log SET {column} = ? WHERE id = ?", new, row_id)
    found = verify(store)

    # Assert: that row, and no row before it
    assert (found.ok, found.first_bad, found.reason, found.rows) == (False, row_id, CONTENT, row_id)
    assert found.message == f"row {row_id}: {CONTENT}"


def test_a_detail_that_is_no_longer_json_names_its_row_and_is_still_listed(store: RunStore, db: Path) -> None:
    # Prepare: one byte of row 2's detail: '{"n": 2}' -> '{"n": 2]'; then a NaN, which JSON has not
    _five(store)
    _sql(db, "UPDATE audit_log SET detail = '{\"n\": 2]' WHERE id = 2")
    _sql(db, "UPDATE audit_log SET detail = '{\"n\": NaN}' WHERE id = 4")

    # Execute
    found = verify(store)
    listed = {r.id: r.detail for r in rows(store)}

    # Assert
    assert (found.first_bad, found.reason) == (2, CONTENT)
    assert listed[2] == {"unreadable": '{"n": 2]'} and listed[3] == {"n": 3}


def test_bytes_that_are_no_utf8_written_into_the_file_name_their_row(store: RunStore, db: Path) -> None:
    # Prepare: row 3's actor as the bytes 'al\xffce' (a hex editor's one-byte change)
    _five(store)
    _sql(db, "UPDATE audit_log SET actor = CAST(X'616cff6365' AS TEXT) WHERE id = 3")

    # Execute
    found = verify(store)
    (listed,) = rows(store, limit=1, actor="alice", action=audit.SUBMIT)  # row 5: the tampered one does not match

    # Assert
    assert (found.first_bad, found.reason) == (3, CONTENT)
    assert listed.id == 5
    assert [r.actor for r in rows(store) if r.id == 3] == ["al\\udcffce"]


def test_a_changed_id_of_the_newest_row_names_it_by_its_new_id(store: RunStore, db: Path) -> None:
    # Prepare: the ids are in the digest; row 5 becomes row 6
    _five(store)
    _sql(db, "UPDATE audit_log SET id = 6 WHERE id = 5")

    # Execute / Assert
    assert (verify(store).first_bad, verify(store).reason) == (6, CONTENT)


def test_a_middle_row_moved_to_the_front_is_named_there(store: RunStore, db: Path) -> None:
    # Prepare: row 3 becomes row 0, read first (0, 1, 2, 4, 5)
    _five(store)
    _sql(db, "UPDATE audit_log SET id = 0 WHERE id = 3")

    # Execute / Assert
    assert (verify(store).first_bad, verify(store).reason) == (0, CONTENT)


def test_a_middle_row_moved_to_the_end_breaks_the_link_of_the_row_after_its_place(store: RunStore, db: Path) -> None:
    # Prepare: row 3 becomes row 9 (read 1, 2, 4, 5, 9): row 4 is the first whose predecessor is not its own
    _five(store)
    _sql(db, "UPDATE audit_log SET id = 9 WHERE id = 3")

    # Execute / Assert
    assert (verify(store).first_bad, verify(store).reason) == (4, LINK)


@pytest.mark.parametrize(("deleted", "named"), [(3, 4), (1, 2)], ids=["middle", "first"])
def test_a_deleted_row_names_the_row_after_it(store: RunStore, db: Path, deleted: int, named: int) -> None:
    # Prepare
    _five(store)

    # Execute
    _sql(db, "DELETE FROM audit_log WHERE id = ?", deleted)
    found = verify(store)

    # Assert
    assert (found.ok, found.first_bad, found.reason) == (False, named, LINK)
    assert found.message == f"row {named}: {LINK}"


def test_a_row_inserted_before_the_first_with_a_valid_digest_is_named(store: RunStore, db: Path) -> None:
    # Prepare: a forged row 0, its digest computed correctly over the genesis link
    _five(store)
    forged = audit.digest_of(0, T0 - 1, "mallory", "", "login", "", {}, GENESIS)
    _sql(db, "INSERT INTO audit_log VALUES (0, ?, 'mallory', '', 'login', '', '{}', ?, ?)", T0 - 1, GENESIS, forged)

    # Execute / Assert: its content and link hold, but a trail starts at id 1
    assert (verify(store).first_bad, verify(store).reason) == (0, "its id is not 1, the first's")


def test_a_row_inserted_after_a_gap_with_a_valid_digest_and_link_is_named(store: RunStore, db: Path) -> None:
    # Prepare: a forged row 7 chained to row 5, digest and link correct (only id 6 is missing)
    written = _five(store)
    forged = audit.digest_of(7, T0 + 9, "mallory", "", "login", "", {}, written[-1].digest)
    _sql(db, "INSERT INTO audit_log VALUES (7, ?, 'mallory', '', 'login', '', '{}', ?, ?)", T0 + 9,
         written[-1].digest, forged)

    # Execute / Assert
    assert (verify(store).first_bad, verify(store).reason) == (7, "its id is not 6, the one after row 5")


def test_rows_appended_after_a_tamper_still_report_the_first_bad_row(store: RunStore, db: Path) -> None:
    # Prepare
    _five(store)
    _sql(db, "UPDATE audit_log SET target = 'run-9' WHERE id = 2")

    # Execute: the chain goes on from the (untouched) newest row
    later = [append(store, "bob", audit.STOP, target="run-1") for _ in range(3)]
    found = verify(store)

    # Assert
    assert [r.id for r in later] == [6, 7, 8]
    assert (found.first_bad, found.reason, found.rows) == (2, CONTENT, 2)


def test_what_it_does_not_prove_a_cut_or_a_rewrite_shows_only_against_a_published_head(
        store: RunStore, db: Path) -> None:
    # Prepare: the head published after row 5
    _five(store)
    published = head(store)

    # Execute: the newest row cut off; then row 2 rewritten, with every digest after it recomputed
    _sql(db, "DELETE FROM audit_log WHERE id = 5")
    cut = verify(store)
    prev = _column(db, "digest", 1)
    for row_id in (2, 3, 4):
        target = "run-forged" if row_id == 2 else f"run-{row_id}"
        digest = audit.digest_of(row_id, _column(db, "at", row_id), "alice", "h1", "submit", target, {"n": row_id},
                                 prev)
        _sql(db, "UPDATE audit_log SET target = ?, prev = ?, digest = ? WHERE id = ?", target, prev, digest, row_id)
        prev = digest
    rewritten = verify(store)

    # Assert: both chains verify; neither leads to the published head
    assert cut.ok and cut.rows == 4 and rewritten.ok and rewritten.rows == 4
    assert published is not None and published not in (cut.head, rewritten.head)


def test_threads_of_separate_stores_appending_at_once_keep_one_linear_chain(
        db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 6 writers, each its own store (its own engine and connections), released together; one try each,
    # so an append that read a head another was writing would fail instead of being retried
    monkeypatch.setattr(audit, "_TRIES", 1)
    stores = [RunStore(_url(db)) for _ in range(6)]
    start, errors = threading.Barrier(len(stores)), []

    def writer(n: int) -> None:
        start.wait()
        try:
            for i in range(15):
                append(stores[n], f"writer-{n}", audit.LOGIN, target=str(i))
        except Exception as exc:  # the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(len(stores))]

    # Execute
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    found = verify(stores[0])

    # Assert: 90 rows, ids 1..90, every writer's 15 in its own order, one chain
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert (found.ok, found.rows) == (True, 90)
    listed = rows(stores[0], limit=1000)
    assert [r.id for r in listed] == list(range(90, 0, -1))
    for n in range(len(stores)):
        assert [r.target for r in reversed(listed) if r.actor == f"writer-{n}"] == [str(i) for i in range(15)]


def test_rows_lists_newest_first_and_filters_by_action_and_actor(store: RunStore) -> None:
    # Prepare
    _five(store)
    append(store, "bob", audit.LOGIN_FAILED, detail={"why": "expired token"})
    append(store, "carol", audit.ACCOUNT_ADD, target="dave", org="h2", detail={"role": "member"})

    # Execute / Assert
    assert [r.id for r in rows(store, limit=3)] == [7, 6, 5]
    assert [r.id for r in rows(store, action=audit.SUBMIT, limit=2)] == [5, 4]
    assert [(r.actor, r.detail) for r in rows(store, actor="bob")] == [("bob", {"why": "expired token"})]
    assert rows(store, actor="nobody") == []


@pytest.mark.parametrize(("call", "named"), [
    (lambda s: append(s, "alice", "delete_everything"), "action 'delete_everything'"),
    (lambda s: append(s, "", audit.LOGIN), "actor: empty"),
    (lambda s: append(s, "a" * 65, audit.LOGIN), "actor: 65 characters, at most 64"),
    (lambda s: append(s, "alice", audit.LOGIN, org="o" * 65), "org: 65 characters, at most 64"),
    (lambda s: append(s, "alice", audit.LOGIN, target="t" * 256), "target: 256 characters, at most 255"),
    (lambda s: append(s, "al\x00ice", audit.LOGIN), "actor 'al\\x00ice': a NUL character"),
    (lambda s: append(s, "alice", audit.LOGIN, detail={"a": {"b": [1, math.nan]}}), "detail['a']['b'][1]: nan"),
    (lambda s: append(s, "alice", audit.LOGIN, detail={"x": -math.inf}), "detail['x']: -inf is not a finite"),
    (lambda s: append(s, "alice", audit.LOGIN, detail={"k": {3: "v"}}), "detail['k']: key 3 is not text (int)"),
    (lambda s: append(s, "alice", audit.LOGIN, detail={"b": b"\x00"}), "detail['b']: a bytes is not JSON"),
    (lambda s: append(s, "alice", audit.LOGIN, detail={"n": 2**300}), "detail['n']: an integer of 301 bits"),
    (lambda s: append(s, "alice", audit.LOGIN, detail={"s": "x" * 20000}), "bytes encoded, at most 16384"),
    (lambda s: append(s, "alice", audit.LOGIN, detail=[1]), "detail: a list, not a JSON object"),
    (lambda s: append(s, "alice", audit.LOGIN, detail={"\ud83d\ude00": 1, "\U0001f600": 2}), "two keys"),
    (lambda s: rows(s, limit=0), "limit 0"),
    (lambda s: rows(s, action="nope"), "action 'nope'"),
], ids=["action", "empty-actor", "long-actor", "long-org", "long-target", "nul", "nan", "inf", "int-key", "bytes",
        "huge-int", "big-detail", "not-object", "pair-keys", "limit", "filter-action"])
def test_bad_fields_are_refused_by_name_and_nothing_is_written(
        store: RunStore, call: Callable[[RunStore], object], named: str) -> None:
    # Execute
    with pytest.raises(AuditError) as refused:
        call(store)

    # Assert
    assert named in str(refused.value)
    assert verify(store).rows == 0


def test_a_detail_nested_deeper_than_the_limit_is_refused(store: RunStore) -> None:
    # Prepare: 40 levels of {"a": ...}
    deep: dict[str, Any] = {}
    for _ in range(40):
        deep = {"a": deep}

    # Execute / Assert
    with pytest.raises(AuditError, match="nested more than 32 levels deep"):
        append(store, "alice", audit.LOGIN, detail=deep)


# -- properties: any detail, actor and target either round-trips exactly or is refused by name -------------------

SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d", "\ude00"])
TEXT = st.text(st.one_of(st.characters(codec=None, exclude_categories=()), SURROGATES), max_size=20)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-2**300, max_value=2**300),
                    st.floats(allow_nan=True, allow_infinity=True), TEXT)
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner),
    st.dictionaries(st.one_of(TEXT, st.integers()), inner, max_size=4)), max_leaves=20)


def _acceptable(value: Any, depth: int = 0) -> bool:
    """What the module promises to take, worked out from its contract (not its code)."""
    if depth > 32:
        return False
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) < 2**256
    if isinstance(value, dict):  # text keys, no two of which JSON writes alike (a surrogate pair, or its character)
        return (len({json.dumps(k) for k in value}) == len(value)
                and all(isinstance(k, str) and _acceptable(v, depth + 1) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return all(_acceptable(v, depth + 1) for v in value)
    return True


def _encoded(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> RunStore:
    return RunStore(_url(tmp_path_factory.mktemp("audit") / "quorum.db"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(detail=st.dictionaries(st.one_of(TEXT, st.integers()), JSONISH, max_size=5))
def test_any_detail_is_stored_exactly_or_refused_naming_its_key(shared_store: RunStore, detail: dict) -> None:
    # Prepare
    before = verify(shared_store).rows

    # Execute
    try:
        written = append(shared_store, "prop", audit.SUBMIT, detail=detail)
    except AuditError as exc:
        refused: AuditError | None = exc
    else:
        refused = None

    # Assert: taken exactly when the contract says so; read back with the same encoding; the chain intact
    found = verify(shared_store)
    assert found.ok
    if refused is None:
        assert _acceptable(detail)
        (read,) = rows(shared_store, limit=1)
        assert read == written and _encoded(read.detail) == _encoded(detail)
        assert found.rows == before + 1
    else:
        assert not _acceptable(detail) or len(_encoded(detail)) > audit.MAX_DETAIL_BYTES, refused
        assert "detail" in str(refused)
        assert found.rows == before


@settings(max_examples=150, deadline=None)
@given(actor=st.text(st.one_of(st.characters(codec=None, exclude_categories=()), SURROGATES), max_size=80),
       target=st.text(st.one_of(st.characters(codec=None, exclude_categories=()), SURROGATES), max_size=300))
def test_any_actor_and_target_are_stored_exactly_or_refused_by_name(
        shared_store: RunStore, actor: str, target: str) -> None:
    # Prepare: what the contract takes: 1-64 and 0-255 characters, UTF-8 without NUL
    def storable(text: str) -> bool:
        return "\x00" not in text and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)

    actor_ok, target_ok = 0 < len(actor) <= 64 and storable(actor), len(target) <= 255 and storable(target)

    # Execute
    try:
        written = append(shared_store, actor, audit.LOGIN, target=target)
    except AuditError as exc:
        # Assert: refused, naming the first field at fault
        assert not (actor_ok and target_ok)
        assert ("actor" if not actor_ok else "target") in str(exc)
        return

    # Assert
    assert actor_ok and target_ok
    (read,) = rows(shared_store, limit=1)
    assert (read.actor, read.target) == (actor, target) and read == written
    assert verify(shared_store).ok


# -- quorum audit ---------------------------------------------------------------------------------------------

def _quorum(*args: str) -> Any:
    from quorum.cli import app

    return CliRunner().invoke(app, ["audit", *args], env={"COLUMNS": "200"})


def test_quorum_audit_verify_says_intact_with_the_head(store: RunStore, db: Path) -> None:
    # Prepare
    written = _five(store)

    # Execute
    out = _quorum("--db", _url(db), "--verify")

    # Assert
    assert out.exit_code == 0, (out.stdout, out.stderr)
    assert out.stdout.strip() == f"audit trail intact: 5 rows, head 5 {written[-1].digest[:16]}"


def test_quorum_audit_verify_exits_1_naming_the_row_with_one_changed_byte(store: RunStore, db: Path) -> None:
    # Prepare: one byte of row 4's target (run-4 -> run-5)
    _five(store)
    _sql(db, "UPDATE audit_log SET target = 'run-5' WHERE id = 4")

    # Execute
    out = _quorum("--db", _url(db), "--verify")
    as_json = _quorum("--db", _url(db), "--verify", "--json")

    # Assert
    assert out.exit_code == 1, (out.stdout, out.stderr)
    assert out.stdout.strip() == f"audit trail broken at row 4: {CONTENT}"
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout) == {"ok": False, "checked": 4, "first_bad": 4, "reason": CONTENT, "head": None,
                                          "exit_code": 1}


def test_quorum_audit_json_lists_the_newest_rows_as_they_were_written(store: RunStore, db: Path) -> None:
    # Prepare
    written = _five(store)

    # Execute
    out = _quorum("--db", _url(db), "--json", "--limit", "2")

    # Assert
    assert out.exit_code == 0, (out.stdout, out.stderr)
    listed = json.loads(out.stdout)["rows"]
    assert [r["id"] for r in listed] == [5, 4]
    assert listed[0] == {"id": 5, "at": T0 + 2.0, "actor": "alice", "org": "h1", "action": "submit",
                         "target": "run-5", "detail": {"n": 5}, "prev": written[3].digest, "digest": written[4].digest}


def test_quorum_audit_shows_a_table_of_the_newest_rows(store: RunStore, db: Path) -> None:
    # Prepare
    _five(store)
    append(store, "token", audit.DOWNLOAD_CHECKPOINT, target="run-2", detail={"round": 3})

    # Execute
    out = _quorum("--db", _url(db), "--action", "download_checkpoint")

    # Assert: only that row; names and the detail as written
    assert out.exit_code == 0, (out.stdout, out.stderr)
    assert "download_checkpoint" in out.stdout and '{"round": 3}' in out.stdout and "alice" not in out.stdout


def test_quorum_audit_on_a_bad_store_or_action_says_one_line_and_exits_2(tmp_path: Path, store: RunStore,
                                                                          db: Path) -> None:
    # Execute
    folder = _quorum("--db", _url(tmp_path), "--verify")
    action = _quorum("--db", _url(db), "--action", "nope")

    # Assert
    assert folder.exit_code == 2 and isinstance(folder.exception, SystemExit)
    assert folder.stderr.startswith("error: the run store") and "is a folder" in folder.stderr
    assert len(folder.stderr.strip().splitlines()) == 1
    assert action.exit_code == 2 and "error: audit action 'nope': one of login" in action.stderr


# -- PostgreSQL: two processes, one chain ---------------------------------------------------------------------

WRITER = """
import sys
from runstore import audit
from runstore.store import RunStore

audit._TRIES = 1  # a lost race fails the process instead of being retried: the advisory lock must prevent it
with RunStore(sys.argv[1]) as store:
    for i in range(100):
        audit.append(store, sys.argv[2], audit.DOWNLOAD_MODEL, target=f"run-{i}", org="h1",
                     detail={"i": i, "x": i / 7, "big": 2**200, "s": "\\u00e9\\udc80\\U0001f600"})
"""


@pytest.mark.e2e
def test_two_processes_appending_on_postgresql_keep_one_chain_that_verifies() -> None:
    with postgres_server() as url:
        # Prepare: the schema made once (each writer would otherwise migrate it under the migration lock anyway)
        RunStore(url).close()

        # Execute: two writer processes at once
        writers = [subprocess.Popen([sys.executable, "-c", WRITER, url, f"proc-{n}"], cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for n in range(2)]
        said = [w.communicate(timeout=240)[0] for w in writers]

        # Assert: one chain of 200 rows whose floats, big integers and escapes hash the same read back from the
        # server; each writer's rows in its own order
        assert [w.returncode for w in writers] == [0, 0], said
        with RunStore(url) as store:
            found = verify(store)
            assert (found.ok, found.rows) == (True, 200), found
            listed = list(reversed(rows(store, limit=500)))
            assert [r.id for r in listed] == list(range(1, 201))
            for n in range(2):
                assert [r.target for r in listed if r.actor == f"proc-{n}"] == [f"run-{i}" for i in range(100)]
            assert listed[0].detail["s"] == "\u00e9\udc80\U0001f600" and listed[0].detail["big"] == 2**200

            # and one byte of one row's detail, changed on the server ("i" -> "j"), names that row
            with store.engine.begin() as connection:
                connection.execute(text("UPDATE audit_log SET detail = CAST(REPLACE(CAST(detail AS TEXT), "
                                        "'\"i\"', '\"j\"') AS JSON) WHERE id = 117"))
            found = verify(store)
            assert (found.first_bad, found.reason) == (117, CONTENT)
