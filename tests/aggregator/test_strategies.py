"""Server optimisers, one step each, against hand-computed values."""

from dataclasses import replace

import numpy as np
import pytest

from aggregator.serverapp import build_strategy
from aggregator.strategies import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi
from core.instructions import TrainConfig
from core.strategy import ServerState, describe
from tests.conftest import tiny_scenario


def vec(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_fedavg_applies_mean_delta_with_server_lr() -> None:
    state = ServerState.initial(vec(1, 1))
    new = FedAvg(server_lr=0.5).apply(state, vec(2, -2))
    np.testing.assert_allclose(new.params, [2, 0])  # 1 + 0.5*2, 1 - 0.5*2
    assert new.round == 1


def test_fedavgm_momentum_two_steps() -> None:
    strategy = FedAvgM(server_lr=1.0, momentum=0.5)
    state = ServerState.initial(vec(0))
    state = strategy.apply(state, vec(1))  # m = 1, x = 1
    state = strategy.apply(state, vec(1))  # m = 0.5*1 + 1 = 1.5, x = 2.5
    np.testing.assert_allclose(state.params, [2.5])
    np.testing.assert_allclose(state.slots["momentum"], [1.5])


def test_fedadam_one_step() -> None:
    strategy = FedAdam(server_lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)
    new = strategy.apply(ServerState.initial(vec(0, 0)), vec(1, -1))
    # m = 0.1*d; v = 0.99*tau^2 + 0.01*d^2 = 0.01000099; step = 0.01*0.1/(sqrt(v)+tau)
    expected = 0.01 * 0.1 / (np.sqrt(0.99e-6 + 0.01) + 1e-3)
    np.testing.assert_allclose(new.params, [expected, -expected], rtol=1e-5)


def test_fedyogi_one_step() -> None:
    strategy = FedYogi(server_lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)
    new = strategy.apply(ServerState.initial(vec(0)), vec(2))
    # v0 = 1e-6, d^2 = 4: v = 1e-6 - 0.01*4*sign(1e-6 - 4) = 1e-6 + 0.04
    v = 1e-6 + 0.04
    expected = 0.01 * 0.2 / (np.sqrt(v) + 1e-3)
    np.testing.assert_allclose(new.params, [expected], rtol=1e-5)
    np.testing.assert_allclose(new.slots["v"], [v], rtol=1e-5)


def test_fedadagrad_two_rounds_against_numpy() -> None:
    # Prepare: Reddi et al. 2021, Algorithm 2 (FedAdagrad), worked out in float64
    eta, beta1, tau = 0.1, 0.9, 1e-3
    x, deltas = np.array([1.0, -2.0]), [np.array([0.5, -1.0]), np.array([-0.2, 0.4])]
    m, v = np.zeros(2), np.full(2, tau**2)
    for delta in deltas:
        m = beta1 * m + (1 - beta1) * delta
        v = v + delta**2
        x = x + eta * m / (np.sqrt(v) + tau)
    strategy = FedAdagrad(server_lr=eta, beta1=beta1, tau=tau)

    # Execute
    state = ServerState.initial(vec(1.0, -2.0))
    for delta in deltas:
        state = strategy.apply(state, delta.astype(np.float32))

    # Assert: round 1 moves each coordinate by eta (1 - beta1) |d| / (|d| + tau) ~ 0.00998 toward the delta's sign
    np.testing.assert_allclose(state.params, x, rtol=1e-6)
    np.testing.assert_allclose(state.slots["v"], [tau**2 + 0.29, tau**2 + 1.16], rtol=1e-6)
    assert state.round == 2


def test_fedadagrad_from_a_scenario_takes_its_keys() -> None:
    strategy = build_strategy(tiny_scenario(strategy={"name": "fedadagrad", "server_lr": 0.05, "beta1": 0.5,
                                                      "tau": 0.01}))
    assert strategy == FedAdagrad(server_lr=0.05, beta1=0.5, tau=0.01)
    assert describe(strategy) == {"name": "fedadagrad", "server_lr": 0.05, "beta1": 0.5, "tau": 0.01}


def test_fedprox_sends_mu_and_averages_like_fedavg() -> None:
    strategy = FedProx(mu=0.7)
    base = TrainConfig(round=3, epochs=1, batch_size=8, lr=0.1, seed=0)
    assert strategy.configure_train(base) == replace(base, proximal_mu=0.7)
    assert FedAvg().configure_train(base) is base
    new = strategy.apply(ServerState.initial(vec(1)), vec(3))
    np.testing.assert_allclose(new.params, [4])


@pytest.mark.parametrize("cls", [FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad, FedProx])
def test_strategies_are_immutable_and_state_is_new(cls: type) -> None:
    strategy = cls()
    state = ServerState.initial(vec(1, 2))
    new = strategy.apply(state, vec(0.5, 0.5))
    np.testing.assert_array_equal(state.params, [1, 2])  # the old state is not changed
    assert new is not state and new.params.dtype == np.float32
