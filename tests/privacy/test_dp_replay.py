"""A DP round interrupted before its commit is replayed once and accounted once (issue 35, item 3)."""

from __future__ import annotations

import numpy as np
import pytest

from core.strategy import ServerState
from privacy.dp.accountant import plan_epsilon
from privacy.dp.state import DPState
from privacy.dp.strategy import DPFedAvg
from runstore.store import RunStore
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario

ROUNDS, Z = 4, 1.0


def _scenario():  # type: ignore[no-untyped-def]
    return tiny_scenario(rounds=ROUNDS, federation={"clients": 8, "clients_per_round": 4},
                         dp={"enabled": True, "noise_multiplier": Z, "sampling": "fixed"})


def test_a_round_killed_after_its_noise_was_drawn_is_replayed_and_accounted_once(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the uninterrupted run's accounting, and an aggregator that dies in round 3 after the noised
    # mean is computed (finalize ran) but before it is applied and committed: nothing of round 3 was released
    reference = simulate(_scenario(), db_url=f"sqlite:///{tmp_path / 'reference.db'}")
    reference_dp = DPState.from_json(RunStore(f"sqlite:///{tmp_path / 'reference.db'}")
                                     .load_state(reference.run_id).wrapper_state["dp"])
    real_apply, died = DPFedAvg.apply, []

    def dies_in_round_3(self: DPFedAvg, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        if state.round == 2 and not died:
            died.append(mean_delta.copy())
            raise KeyboardInterrupt  # the process is stopped here (SIGINT): the run reads interrupted
        return real_apply(self, state, mean_delta)

    monkeypatch.setattr(DPFedAvg, "apply", dies_in_round_3)
    db = f"sqlite:///{tmp_path / 'killed.db'}"
    store = RunStore(db)

    # Execute: the run dies in round 3; the same scenario resumes it
    with pytest.raises(KeyboardInterrupt):
        simulate(_scenario(), db_url=db)
    run_id = store.list_runs()[0].id
    interrupted = store.get_run(run_id)
    before = DPState.from_json(store.load_state(run_id).wrapper_state["dp"])
    stored_before = [r.round for r in store.rounds(run_id)]
    resumed = simulate(_scenario(), db_url=db, resume_id=run_id)

    # Assert: round 3 left nothing behind; after the resume every round is stored and accounted exactly once,
    # with the epsilon of an uninterrupted run (the library's figure for four rounds, fixed-size sampling)
    assert died and interrupted.status == "interrupted" and interrupted.rounds_done == 2
    assert stored_before == [1, 2] and before.rounds == 2
    after = DPState.from_json(store.load_state(run_id).wrapper_state["dp"])
    assert resumed.status == "finished" and [r.round for r in store.rounds(run_id)] == [1, 2, 3, 4]
    assert after.rounds == reference_dp.rounds == ROUNDS
    assert after.epsilon == pytest.approx(reference_dp.epsilon, rel=1e-12)
    assert after.epsilon == pytest.approx(plan_epsilon(4 / 8, ROUNDS, Z, 1e-5, "fixed"), rel=1e-9)
    assert [r.epsilon for r in store.rounds(run_id)] == pytest.approx(
        [r.epsilon for r in RunStore(f"sqlite:///{tmp_path / 'reference.db'}").rounds(reference.run_id)], rel=1e-12)
