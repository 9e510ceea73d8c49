"""``[dp] local_dp_sgd``: clients train with DP-SGD and report the sample-level epsilon."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant
from dp_support import blobs

from core.instructions import TrainConfig
from learning.models import build_model, get_flat
from learning.training import train
from privacy.dp.dpsgd import DP_SGD_METRIC, train_client
from scenarios.threats import DPSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _epsilon_by_hand(rate: float, steps: int, z: float, delta: float) -> float:
    """The Poisson-subsampled Gaussian of every step, composed with the library's RDP accountant directly."""
    accountant = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(z)), steps)
    return float(accountant.get_epsilon(delta))


def test_local_dp_sgd_changes_training_and_reports_the_accountants_epsilon(rng: np.random.Generator) -> None:
    # Prepare: 200 examples, batches of 20, 2 epochs: 2 * ceil(200 / 20) = 20 steps at q = 0.1, z = 1.1
    data = blobs(200, rng)
    config = TrainConfig(round=1, epochs=2, batch_size=20, lr=0.1, seed=5)
    spec = DPSpec(local_dp_sgd=True, local_noise_multiplier=1.1, local_max_grad_norm=0.5, delta=1e-5)
    models = [build_model("logreg", (10,), 2, seed=0) for _ in range(3)]
    start = get_flat(models[0])
    # Execute: the same seed for all three; DP-SGD draws from its own seeded generator
    _, plain_metrics = train_client(models[0], data, config, DPSpec(), seed=7, rng=np.random.default_rng(1))
    train(models[1], data, epochs=2, batch_size=20, lr=0.1, seed=7)
    result, metrics = train_client(models[2], data, config, spec, seed=7, rng=np.random.default_rng(1))
    # Assert: off, it is exactly plain SGD; on, the update differs and is bounded by clipping
    plain, reference, private = (get_flat(m) - start for m in models)
    np.testing.assert_array_equal(plain, reference)
    assert plain_metrics == {}
    assert float(np.linalg.norm(private - plain)) > 0.1 * float(np.linalg.norm(plain))
    assert result.num_examples == 200 and result.steps == 20
    assert metrics[DP_SGD_METRIC] == pytest.approx(_epsilon_by_hand(0.1, 20, 1.1, 1e-5), rel=1e-9)


def test_local_dp_sgd_without_noise_reports_no_epsilon(rng: np.random.Generator) -> None:
    spec = DPSpec(local_dp_sgd=True, local_noise_multiplier=0.0)
    config = TrainConfig(round=1, epochs=1, batch_size=10, lr=0.1, seed=0)
    _, metrics = train_client(build_model("logreg", (10,), 2, seed=0), blobs(30, rng), config, spec, seed=0, rng=rng)
    assert metrics == {}  # infinite: nothing to show as a finite figure


def test_clients_report_dp_sgd_epsilon_through_a_federation(db_url: str) -> None:
    from runstore.store import RunStore
    from runtimes.simulation import simulate
    from tests.conftest import tiny_scenario

    # Prepare: 4 clients, batch 16, 1 epoch, z = 1.2 on every client's examples (no client-level DP)
    # (a generous deadline: each worker process imports torch.func and the accountant on first use)
    scenario = tiny_scenario(rounds=1, federation={"deadline_s": 180.0},
                             dp={"local_dp_sgd": True, "local_noise_multiplier": 1.2, "local_max_grad_norm": 1.0,
                                 "delta": 1e-5})
    # Execute
    summary = simulate(scenario, db_url=db_url)
    # Assert: each client's figure is the accountant's for its own n: q = 16 / n, ceil(n / 16) steps
    store = RunStore(db_url)
    (row,) = store.rounds(summary.run_id)
    assert row.epsilon is None  # no client-level DP: no run epsilon
    results = [c for c in store.client_results(summary.run_id, 1) if c.outcome == "ok"]
    assert len(results) == 4
    for c in results:
        n = c.num_examples
        assert c.metrics[DP_SGD_METRIC] == pytest.approx(_epsilon_by_hand(16 / n, math.ceil(n / 16), 1.2, 1e-5),
                                                         rel=1e-9)
