"""A run's lease (issue 32, item 2): a running run whose process stopped renewing reads ``interrupted``.

The store's clock is injected: the lease expires by moving the clock, not by waiting.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import StoreError
from runstore.lease import LEASE_ENV, LEASE_S, MAX_LEASE_S, MIN_LEASE_S, Heartbeat, lease_seconds
from runstore.store import RunStore
from tests.conftest import wait_for


class Clock:
    """A settable clock (seconds since the epoch)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def store_at(db_url: str, clock: Clock) -> RunStore:
    return RunStore(db_url, clock=clock)


def new_run(store: RunStore) -> str:
    return store.create_run(name="t", scenario={"name": "t"}, seed=1, strategy="fedavg", rounds=3)


def test_a_run_reads_running_while_its_lease_lasts_and_interrupted_after(db_url: str) -> None:
    # Prepare: a run created at t0 (its first lease: LEASE_S)
    clock = Clock()
    store = store_at(db_url, clock)
    run_id = new_run(store)
    t0 = clock.now

    # Execute / Assert: still running just before the lease ends, interrupted just after, last seen at t0
    clock.now = t0 + LEASE_S - 1
    assert store.get_run(run_id).status == "running"
    assert [r.id for r in store.list_runs("running")] == [run_id] and store.list_runs("interrupted") == []
    clock.now = t0 + LEASE_S + 1
    run = store.get_run(run_id)
    assert (run.status, run.heartbeat_at) == ("interrupted", t0)
    assert [r.id for r in store.list_runs("interrupted")] == [run_id] and store.list_runs("running") == []
    assert [r.status for r in store.list_runs()] == ["interrupted"]


def test_a_renewed_lease_keeps_the_run_running(db_url: str) -> None:
    clock = Clock()
    store = store_at(db_url, clock)
    run_id = new_run(store)
    t0 = clock.now

    clock.now = t0 + 20
    store.renew_lease(run_id, LEASE_S)
    clock.now = t0 + LEASE_S + 10  # past the first lease, within the renewed one

    run = store.get_run(run_id)
    assert (run.status, run.heartbeat_at, run.lease_until) == ("running", t0 + 20, t0 + 20 + LEASE_S)


def test_the_stored_status_stays_running_so_a_paused_owner_that_renews_is_running_again(db_url: str) -> None:
    clock = Clock()
    store = store_at(db_url, clock)
    run_id = new_run(store)
    clock.now += LEASE_S + 5
    assert store.get_run(run_id).status == "interrupted"

    store.renew_lease(run_id, LEASE_S)  # the owner woke up

    assert store.get_run(run_id).status == "running"


@pytest.mark.parametrize("status", ["finished", "degraded", "failed", "stopped_budget"])
def test_a_run_that_ended_is_never_interrupted(db_url: str, status: str) -> None:
    # Prepare: a run that ended, and a late beat of its heartbeat (renewal is for running runs only)
    clock = Clock()
    store = store_at(db_url, clock)
    run_id = new_run(store)
    store.set_status(run_id, status)
    store.renew_lease(run_id, LEASE_S)

    # Execute: long after
    clock.now += 10 * LEASE_S

    # Assert
    run = store.get_run(run_id)
    assert (run.status, run.lease_until) == (status, None)
    assert store.list_runs("interrupted") == []


def test_resuming_grants_a_fresh_lease(db_url: str) -> None:
    clock = Clock()
    store = store_at(db_url, clock)
    run_id = new_run(store)
    clock.now += LEASE_S + 5
    assert store.get_run(run_id).status == "interrupted"

    store.set_status(run_id, "running")  # what open_run does when it resumes the run

    assert store.get_run(run_id).status == "running"


def test_a_run_written_before_leases_is_taken_at_its_word(tmp_path: Path) -> None:
    # Prepare: a store as an older Quorum wrote it (no lease columns), with a running run
    path = tmp_path / "old.db"
    RunStore(f"sqlite:///{path}")
    with sqlite3.connect(path) as db:
        db.execute("DROP TABLE alembic_version")  # written before the store had migrations
        db.execute("ALTER TABLE runs DROP COLUMN heartbeat_at")
        db.execute("ALTER TABLE runs DROP COLUMN lease_until")
        db.execute("INSERT INTO runs (id, name, scenario, seed, status, engine, strategy, rounds_total, rounds_done, "
                   "num_params, started_at, updated_at, info) VALUES ('r1', 'old', '{}', 0, 'running', 'inprocess', "
                   "'fedavg', 3, 1, 0, 0, 0, '{}')")

    # Execute: opened by this version (the columns are added), much later
    store = store_at(f"sqlite:///{path}", Clock(10**9))

    # Assert: no lease to lose, so still running
    run = store.get_run("r1")
    assert (run.status, run.heartbeat_at, run.lease_until) == ("running", None, None)


def test_a_heartbeat_renews_the_lease_until_stopped(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a short lease (renewed every 1/6 of it)
    monkeypatch.setenv(LEASE_ENV, "0.6")
    store = RunStore(db_url)
    run_id = new_run(store)
    first = store.get_run(run_id).lease_until

    # Execute / Assert: the thread moves the lease forward, and ends with stop()
    with Heartbeat(store, run_id) as beat:
        assert beat.lease_s == 0.6
        wait_for(lambda: store.get_run(run_id).lease_until > first + 0.05, 10, "a renewal of the lease")
    assert not beat._thread.is_alive()


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "nan", "inf"])
def test_a_bad_lease_setting_names_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(LEASE_ENV, raw)
    with pytest.raises(StoreError, match=rf"^{LEASE_ENV}='{raw}': the run lease must be a number of seconds"):
        lease_seconds()


@pytest.mark.parametrize("raw", ["1e308", "-1", "abc", "0", "0.05", "604801", "1" + "0" * 400, "nan"])
def test_a_lease_outside_its_range_is_one_line_with_the_range(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    # Prepare: 1e308 s would overflow the renewing thread's wait; 0.05 s would renew 120 times a second
    monkeypatch.setenv(LEASE_ENV, raw)

    # Execute
    with pytest.raises(StoreError) as info:
        lease_seconds()

    # Assert
    assert str(info.value) == (f"{LEASE_ENV}={raw!r}: the run lease must be a number of seconds in "
                               "[0.1, 604,800] (default 30)")


def test_the_lease_ranges_from_a_tenth_of_a_second_to_a_week(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: each end, just inside and just outside (None: refused), and unset
    cases = {"0.1": 0.1, "0.0999": None, " 2 ": 2.0, "604800": 604_800.0, "604800.5": None, "": LEASE_S}

    # Execute
    read = {}
    for raw in cases:
        monkeypatch.setenv(LEASE_ENV, raw)
        try:
            read[raw] = lease_seconds()
        except StoreError:
            read[raw] = None

    # Assert
    assert read == cases


@settings(max_examples=100, deadline=None)
@given(st.floats() | st.integers(min_value=-(2**70), max_value=2**70)
       | st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=6))
def test_any_lease_setting_is_one_in_range_or_refused_in_one_line(value: object) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(LEASE_ENV, str(value))
        try:
            seconds = lease_seconds()
        except StoreError as exc:
            assert str(exc).startswith(f"{LEASE_ENV}=") and "\n" not in str(exc)
            return
    assert seconds == LEASE_S or MIN_LEASE_S <= seconds <= MAX_LEASE_S


def test_a_heartbeat_refuses_a_lease_its_thread_could_not_wait(db_url: str) -> None:
    # Prepare: a lease whose renewal wait (1e308 / 6 s) no timer holds
    store = RunStore(db_url)
    run_id = new_run(store)

    # Execute / Assert: refused where it is given, not in the thread
    with pytest.raises(StoreError, match=r"^lease_s=1e\+308: the run lease must be a number of seconds in "
                                         r"\[0\.1, 604,800\]$"):
        Heartbeat(store, run_id, lease_s=1e308)
