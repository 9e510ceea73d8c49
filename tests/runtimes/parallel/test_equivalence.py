"""The two modes against their single-process definitions.

Synchronous mode must equal plain SGD on the concatenation of the ranks'
batches; local-SGD mode must equal the in-process federated simulation of the
same scenario (same sampling, client seeds, training, aggregation and
strategy). Both runs are real two-process gloo jobs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parallel_support import reference_sync

from learning.federation import build_federation
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.schema import load_scenario

pytestmark = pytest.mark.e2e  # real processes (docs/testing.md)

JOB_TIMEOUT = 120


def _run(start_job, scenario_path, db_url, *extra: str) -> tuple[RunStore, str]:
    rc, out, err = start_job([str(scenario_path), "--nproc", "2", "--db", db_url, "--json", *extra]).wait(JOB_TIMEOUT)
    assert rc == 0, err
    store = RunStore(db_url)
    return store, store.list_runs()[0].id


def test_sync_equals_sgd_on_concatenated_batches_with_uneven_shards(start_job, scenario_file, db_url):
    # Prepare: 3 clients over 2 ranks (rank 0 holds clients 0 and 2), so the shards differ in size.
    path = scenario_file(clients=3, rounds=2, momentum=0.5, federated="false")
    scenario = load_scenario(path)
    fed = build_federation(scenario.data, 3, scenario.seed)
    sizes = [len(fed.clients[0].train) + len(fed.clients[2].train), len(fed.clients[1].train)]
    assert sizes[0] > 1.5 * sizes[1]  # the ranks' batches differ in size at every step
    # Execute
    store, run_id = _run(start_job, path, db_url)
    # Assert
    params = store.load_state(run_id).params
    expected = reference_sync(scenario, world=2)
    np.testing.assert_allclose(params, expected, rtol=0, atol=2e-5)
    run = store.get_run(run_id)
    assert (run.engine, run.status, run.rounds_done) == ("parallel", "finished", 2)
    rows = {c.client: c.num_examples for c in store.client_results(run_id, 1)}
    assert rows == {"rank-0": sizes[0], "rank-1": sizes[1]}


def test_localsgd_equals_the_federated_simulation(start_job, scenario_file, db_url, tmp_path):
    # Prepare: half the clients sampled per round, a server optimiser with state (momentum).
    path = scenario_file(clients=4, fraction=0.5, rounds=3, strategy="fedavgm", momentum=0.0, federated="true")
    scenario = load_scenario(path)
    torch.set_num_threads(1)
    sim = simulate(scenario, db_url=f"sqlite:///{tmp_path / 'sim.db'}")
    expected = RunStore(sim.db).load_state(sim.run_id)
    # Execute
    store, run_id = _run(start_job, path, db_url, "--mode", "localsgd")
    # Assert
    got = store.load_state(run_id)
    np.testing.assert_allclose(got.params, expected.params, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got.slots["momentum"], expected.slots["momentum"], rtol=0, atol=1e-5)
    sim_rounds, par_rounds = RunStore(sim.db).rounds(sim.run_id), store.rounds(run_id)
    assert [r.sampled for r in par_rounds] == [r.sampled for r in sim_rounds] == [2, 2, 2]
    for ours, theirs in zip(par_rounds, sim_rounds, strict=True):
        assert abs(ours.train_loss - theirs.train_loss) < 1e-5
        assert abs(ours.fed_accuracy - theirs.fed_accuracy) < 1e-9
        assert abs(ours.server_accuracy - theirs.server_accuracy) < 1e-9
    clients = sorted((c.round, c.client, c.num_examples) for c in store.client_results(run_id))
    assert clients == sorted((c.round, c.client, c.num_examples) for c in RunStore(sim.db).client_results(sim.run_id))
