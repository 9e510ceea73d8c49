"""The queue of remote submissions (``runstore/submissions.py``): enqueue, take once, finish."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from runstore.store import RunStore
from runstore.submissions import DONE, FAILED, PENDING, TAKEN, SubmissionError, attach_run, enqueue, finish, get, take

SPEC = {"name": "tiny", "rounds": 1}


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(f"sqlite:///{tmp_path / 'quorum.db'}")


def test_a_submission_is_taken_once_in_order_and_finished(store: RunStore) -> None:
    # Prepare: two pending requests, one for another federation
    first = enqueue(store, "lead-n", "north", "submit", scenario=SPEC)
    other = enqueue(store, "lead-s", "south", "stop", federation="elsewhere", run_id="r1")
    second = enqueue(store, "lead-n", "north", "resume", federation="fed", run_id="r2")
    # Execute / Assert: oldest first, only this federation's (or any federation's), then nothing
    taken = take(store, "agg-1", "fed")
    assert taken is not None and (taken.id, taken.status, taken.scenario, taken.taken_by) == (
        first, TAKEN, SPEC, "agg-1")
    assert take(store, "agg-1", "fed").id == second  # type: ignore[union-attr]
    assert take(store, "agg-1", "fed") is None
    assert get(store, other).status == PENDING  # type: ignore[union-attr]
    finish(store, first, True, flower_run_id=77)
    attach_run(store, first, "run-abc")
    finish(store, second, False, error="no such run")
    done, failed = get(store, first), get(store, second)
    assert done is not None and (done.status, done.result, done.run_id) == (DONE, {"flower_run_id": 77}, "run-abc")
    assert failed is not None and (failed.status, failed.result) == (FAILED, {"error": "no such run"})
    assert get(store, 999) is None


@pytest.mark.parametrize(("kind", "fields", "says"), [
    ("launch", {"scenario": SPEC}, "kind"),
    ("submit", {}, "scenario"),
    ("stop", {}, "run"),
    ("resume", {"scenario": SPEC}, "run"),
], ids=["unknown-kind", "submit-without-scenario", "stop-without-run", "resume-without-run"])
def test_a_request_without_what_its_kind_needs_is_refused(store: RunStore, kind: str, fields: dict[str, object],
                                                          says: str) -> None:
    with pytest.raises(SubmissionError, match=says):
        enqueue(store, "lead-n", "north", kind, **fields)  # type: ignore[arg-type]


def test_two_takers_never_take_the_same_submission(store: RunStore, tmp_path: Path) -> None:
    # Prepare: 20 pending requests; two aggregators, each with its own store (engine, connections)
    ids = {enqueue(store, "lead-n", "north", "submit", scenario=SPEC) for _ in range(20)}
    stores = [RunStore(store.url), RunStore(store.url)]
    taken: list[list[int]] = [[], []]
    start = threading.Barrier(2)

    def drain(i: int) -> None:
        start.wait(timeout=10)
        while (found := take(stores[i], f"agg-{i}", "fed")) is not None:
            taken[i].append(found.id)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    # Execute
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    # Assert: every request taken, by one taker only
    assert not any(t.is_alive() for t in threads)
    assert sorted(taken[0] + taken[1]) == sorted(ids)
    assert set(taken[0]).isdisjoint(taken[1])
    assert {get(store, i).taken_by for i in taken[0]} <= {"agg-0"}  # type: ignore[union-attr]
    for s in stores:
        s.close()
