"""The aggregator's lead on a real PostgreSQL: one holder, the standby let in when the holder's connection dies.

Attacks on the claim "only one aggregator leads": a second claimant while the
first holds it, the holder killed with SIGKILL (no clean-up of its own), the
holder's connection ended by the server, and a federation of another name
(which must not be blocked).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from core.errors import StoreError
from runstore.leader import Leadership, lock_key, supports_leadership
from tests.conftest import wait_for
from tests.postgres_server import postgres_server


@given(st.text(max_size=300))
def test_every_federation_name_has_a_bigint_key_that_depends_on_the_name_only(name: str) -> None:
    key = lock_key(name)
    assert -(2**63) <= key < 2**63 and key == lock_key(name)
    assert lock_key(name) != lock_key(name + "x")


def test_a_lead_on_sqlite_is_refused_naming_postgresql() -> None:
    assert not supports_leadership("sqlite:///runs/quorum.db")
    with pytest.raises(StoreError, match=r"needs a PostgreSQL run store.*this store is sqlite"):
        Leadership("sqlite:///runs/quorum.db", "fed")


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


@pytest.mark.e2e
def test_one_aggregator_leads_and_the_other_is_told_who(pg_url: str) -> None:
    # Prepare
    first, second = Leadership(pg_url, "fed-a", who="host-1 pid 1"), Leadership(pg_url, "fed-a", who="host-2 pid 2")
    other = Leadership(pg_url, "fed-b", who="host-3 pid 3")
    try:
        # Execute / Assert: the first takes it, the second is refused and hears who holds it
        assert first.try_acquire() and first.alive()
        assert not second.try_acquire() and not second.alive()
        assert (second.holder() or "").startswith("host-1 pid 1")
        assert other.try_acquire(), "another federation on the same database is not blocked"
        # the first gives it up: the second takes it
        first.release()
        assert second.try_acquire() and second.alive() and not first.alive()
    finally:
        for lead in (first, second, other):
            lead.release()


@pytest.mark.e2e
def test_a_leader_killed_by_sigkill_lets_the_waiting_standby_in(pg_url: str) -> None:
    # Prepare: a leader in another process, which dies without any clean-up of its own
    code = ("import sys, time; from runstore.leader import Leadership; "
            f"lead = Leadership({pg_url!r}, 'fed-k', who='doomed'); assert lead.try_acquire(); "
            "print('leading', flush=True); time.sleep(600)")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    standby = Leadership(pg_url, "fed-k", who="standby")
    stop, took = threading.Event(), []
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "leading"
        heard: list[str] = []
        waiter = threading.Thread(target=lambda: took.append(standby.wait(stop, poll_s=0.1, say=heard.append)))
        waiter.start()
        wait_for(lambda: heard, 10, lambda: "the standby to say who leads", poll_s=0.05)
        assert "doomed" in heard[0] and "waiting" in heard[0], heard
        assert not took, "the standby led while the leader lived"

        # Execute
        killed = time.monotonic()
        leader.kill()
        leader.wait()
        waiter.join(timeout=10)

        # Assert: in well under a second's polls, no lease to wait out
        assert took == [True] and standby.alive()
        assert time.monotonic() - killed < 5
    finally:
        stop.set()
        if leader.poll() is None:
            leader.kill()
            leader.wait()
        if leader.stdout is not None:
            leader.stdout.close()
        standby.release()


@pytest.mark.e2e
def test_a_leader_killed_while_a_forked_child_lives_on_lets_the_standby_in(pg_url: str) -> None:
    # Prepare: a leader that forks a worker (as the in-process pool does) after it took the lock; the
    # worker inherits the lock connection's socket and outlives the leader
    code = ("import os, sys, time; from runstore.leader import Leadership; "
            f"lead = Leadership({pg_url!r}, 'fed-f', who='forking'); assert lead.try_acquire(); "
            "child = os.fork()\n"
            "if child == 0:\n    time.sleep(60); os._exit(0)\n"
            "print(child, flush=True); time.sleep(600)")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    standby = Leadership(pg_url, "fed-f", who="standby")
    worker = 0
    try:
        assert leader.stdout is not None
        worker = int(leader.stdout.readline().strip())
        assert not standby.try_acquire()

        # Execute: the leader dies; its forked worker lives on
        leader.kill()
        leader.wait()

        # Assert: the worker's copy of the socket did not keep the session, so the lock is free at once
        assert wait_for(lambda: standby.try_acquire(), 5, "the lock, with the leader's worker still alive",
                        poll_s=0.1)
        assert os.path.exists(f"/proc/{worker}")
    finally:
        if worker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        if leader.poll() is None:
            leader.kill()
            leader.wait()
        if leader.stdout is not None:
            leader.stdout.close()
        standby.release()


@pytest.mark.e2e
def test_a_leader_whose_connection_the_server_ended_knows_it_no_longer_leads(pg_url: str) -> None:
    # Prepare
    leader, standby = Leadership(pg_url, "fed-t", who="cut-off"), Leadership(pg_url, "fed-t", who="standby")
    admin = create_engine(pg_url)
    try:
        assert leader.try_acquire() and leader.alive()

        # Execute: an administrator (or a server restart) ends the leader's connection
        with admin.begin() as conn:
            ended = conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                      "WHERE application_name LIKE '%cut-off%'")).scalars().all()
        assert ended == [True]

        # Assert: the leader sees it at its next check, and the standby leads
        assert not leader.alive()
        assert standby.try_acquire() and standby.alive()
    finally:
        leader.release()
        standby.release()
        admin.dispose()
