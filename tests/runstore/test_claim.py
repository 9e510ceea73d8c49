"""Taking a run to resume it (issue 47, item 7): one conditional write, refused while a live process drives it.

``TakenRunStore.claim`` is what ``quorum resume`` does before it prints or
writes anything: a run whose driver still renews its lease is left alone
(:class:`RunHeld`, naming the run and its holder); one whose process was
killed (lease expired), stopped (no lease) or that this store holds already
is taken. A deployment's ``take`` still takes a run whoever holds it, and the
driver it fenced out writes nothing more, not even a line of the run's log.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from sqlalchemy import update

from core.records import RoundRecord
from core.status import RunStatus
from core.strategy import ServerState
from runstore.store import LeaseLost, Run, RunStore
from runstore.takeover import RunHeld, TakenRunStore


def new_run(store: RunStore) -> str:
    return store.create_run(name="t", scenario={"name": "t"}, seed=1, strategy="fedavg", rounds=3)


def set_row(store: RunStore, run_id: str, **values: object) -> None:
    with store.session() as s, s.begin():
        s.execute(update(Run).where(Run.id == run_id).values(**values))


def row(store: RunStore, run_id: str) -> tuple[object, ...]:
    run = store.get_run(run_id)
    return run.status, run.holder, run.heartbeat_at, run.lease_until


def record(server_round: int) -> RoundRecord:
    return RoundRecord(round=server_round, started_at=0.0, duration_s=1.0, sampled=0, clients=[])


def state(server_round: int) -> ServerState:
    return ServerState(params=np.zeros(3, np.float32), round=server_round)


def test_a_run_whose_driver_renews_its_lease_is_refused_naming_it_and_left_as_it_was(db_url: str) -> None:
    # Prepare: a run its driver holds, its lease fresh
    driver, resumer = TakenRunStore(db_url), TakenRunStore(db_url)
    run_id = new_run(driver)
    driver.take(run_id)
    before = row(driver, run_id)

    # Execute
    with pytest.raises(RunHeld) as refused:
        resumer.claim(run_id)

    # Assert: one line naming the run, its holder and its lease; nothing written
    until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(driver.get_run(run_id).lease_until))
    assert str(refused.value) == (f"run {run_id} is being driven by {driver.holder} (lease until {until}); "
                                  "resume it when that process stopped")
    assert (refused.value.run_id, refused.value.holder) == (run_id, driver.holder)
    assert row(driver, run_id) == before


def test_a_live_run_nobody_took_is_refused_too(db_url: str) -> None:
    # a run driven by a store without a holder (a data-parallel job's rank 0, a Ray engine's ServerApp)
    store = RunStore(db_url)
    run_id = new_run(store)
    with pytest.raises(RunHeld, match=f"^run {run_id} is being driven by another process"):
        TakenRunStore(db_url).claim(run_id)


@pytest.mark.parametrize("left", ["killed", "interrupted", "failed", "before leases"])
def test_a_run_whose_driver_is_gone_is_claimed_with_a_fresh_lease(db_url: str, left: str) -> None:
    # Prepare: how each ending leaves the row (killed: running, its lease past; Ctrl-C or an error: no lease)
    old = TakenRunStore(db_url)
    run_id = new_run(old)
    old.take(run_id)
    ended: dict[str, dict[str, object]] = {"killed": dict(lease_until=time.time() - 1),
                                "interrupted": dict(status=RunStatus.INTERRUPTED, lease_until=None),
                                "failed": dict(status=RunStatus.FAILED, lease_until=None),
                                "before leases": dict(holder=None, lease_until=None, heartbeat_at=None)}
    set_row(old, run_id, **ended[left])
    status = old.get_run(run_id).status
    new = TakenRunStore(db_url)

    # Execute
    new.claim(run_id)
    new.claim(run_id)  # again: this store holds it

    # Assert: held by the new store, its lease running; the status is its driver's to set
    run = new.get_run(run_id)
    assert (run.holder, run.status) == (new.holder, status if left != "killed" else RunStatus.RUNNING)
    assert run.lease_until is not None and run.lease_until > time.time() + 5
    with pytest.raises(RunHeld):
        TakenRunStore(db_url).claim(run_id)  # a third process is refused from now on
    with pytest.raises(LeaseLost, match=f"^lost run {run_id} to {new.holder}: another process took it over at "
                                        "round 0; this one stopped without writing$"):
        old.commit_round(run_id, record(1), state(1))


def test_of_two_claims_at_once_one_takes_the_run(db_url: str) -> None:
    # Prepare: an interrupted run, two processes' stores, released together
    run_id = new_run(RunStore(db_url))
    set_row(RunStore(db_url), run_id, status=RunStatus.INTERRUPTED, lease_until=None)
    stores = [TakenRunStore(db_url) for _ in range(2)]
    gate, outcomes = threading.Barrier(2), list[str | RunHeld]()

    def claim(store: TakenRunStore) -> None:
        gate.wait(timeout=10)
        try:
            store.claim(run_id)
            outcomes.append(str(store.holder))
        except RunHeld as exc:
            outcomes.append(exc)

    # Execute
    threads = [threading.Thread(target=claim, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)

    # Assert: one holder, the other refused naming it
    won = [o for o in outcomes if isinstance(o, str)]
    lost = [o for o in outcomes if isinstance(o, RunHeld)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert lost[0].holder == won[0] == RunStore(db_url).get_run(run_id).holder


def test_release_frees_a_run_claimed_and_never_driven_at_once(db_url: str) -> None:
    # Prepare
    first, second = TakenRunStore(db_url), TakenRunStore(db_url)
    run_id = new_run(first)
    set_row(first, run_id, status=RunStatus.INTERRUPTED, lease_until=None)
    first.claim(run_id)

    # Execute
    second.release(run_id)  # not its run: nothing happens
    with pytest.raises(RunHeld):
        second.claim(run_id)
    first.release(run_id)

    # Assert: the next resume takes it without waiting for a lease to pass
    second.claim(run_id)
    assert second.get_run(run_id).holder == second.holder


def test_a_driver_fenced_out_writes_no_log_line(db_url: str) -> None:
    # Prepare: the old driver logged a line; a deployment's ServerApp took the run over
    old, new = TakenRunStore(db_url), TakenRunStore(db_url)
    run_id = new_run(old)
    old.take(run_id)
    old.log(run_id, "round 1: 2/3 answered")
    new.take(run_id)

    # Execute / Assert
    with pytest.raises(LeaseLost, match=f"^lost run {run_id} to {new.holder}"):
        old.log(run_id, "round 2: 2/3 answered")
    new.log(run_id, "resumed after round 1")
    RunStore(db_url).log(run_id, "a reader's note")  # a store without a holder is not fenced
    assert [e.message for e in new.events(run_id)] == ["round 1: 2/3 answered", "resumed after round 1",
                                                       "a reader's note"]
