"""The core ``Strategy``: six methods, generic in its aggregate; DP's hooks live on the DP wrapper only."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

from aggregator.strategies import (
    CenteredClipping,
    FedAdagrad,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedMean,
    Krum,
    Scaffold,
)
from core import aggregate
from core.strategy import (
    MeanStrategy,
    PrivateStrategy,
    ServerState,
    Strategy,
    bind_cohort,
    describe,
    epsilon,
    fold_secure_sum,
    initial_state,
    round_metrics,
    round_rng,
    sample_clients,
    skips_short_rounds,
    would_exceed_budget,
)
from privacy.dp.bounding import CentredTerms
from privacy.dp.strategy import DPFedAvg

ROOT = Path(__file__).resolve().parents[2]


def _dp(**kw: object) -> DPFedAvg:
    settings: dict[str, object] = {"inner": FedAvg(), "clip_norm": 1.0, "noise_multiplier": 1.0,
                                   "expected_clients": 2, "population": 4, "delta": 1e-5, **kw}
    return DPFedAvg(**settings)  # type: ignore[arg-type]


def test_the_core_strategy_has_six_methods_and_no_any_in_its_signatures() -> None:
    # the methods Strategy itself defines (not inherited from ABC/Generic/object)
    own = [name for name, value in vars(Strategy).items() if inspect.isfunction(value) and not name.startswith("__")]
    assert sorted(own) == ["accumulate", "apply", "configure_train", "finalize", "for_round", "new_aggregate"]
    # ... and none of their signatures, in the source, says Any: the aggregate is the type parameter
    tree = ast.parse((ROOT / "core" / "strategy.py").read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    signatures = [ast.unparse(f.args) + " -> " + ast.unparse(f.returns or ast.Constant(None))
                  for f in cls.body if isinstance(f, ast.FunctionDef)]
    assert len(signatures) == 6 and not [s for s in signatures if "Any" in s], signatures
    assert "AggregateState" not in (ROOT / "core" / "strategy.py").read_text(encoding="utf-8")


def test_no_plain_strategy_carries_a_privacy_hook() -> None:
    hooks = {name for name, value in vars(PrivateStrategy).items() if getattr(value, "__isabstractmethod__", False)}
    assert {"sample", "noise_rng", "with_cohort", "fold_sum", "epsilon", "would_exceed_budget"} <= hooks
    for strategy in (FedAvg(), FedProx(), FedAvgM(), FedAdagrad(), Scaffold(), CenteredClipping(), FedMedian(),
                     Krum(), FedTrimmedMean()):
        assert not isinstance(strategy, PrivateStrategy)
        assert not hooks & set(dir(strategy)), type(strategy).__name__
    assert isinstance(_dp(), PrivateStrategy) and isinstance(_dp(), Strategy)


def test_a_plain_round_samples_and_draws_from_its_seed_a_private_one_from_secret_generators() -> None:
    ids = list(range(1, 21))
    plain = FedAvg()
    # the same (seed, round) gives the same clients and the same draws; another round, others
    assert sample_clients(plain, ids, 5, 7, 3) == sample_clients(plain, list(reversed(ids)), 5, 7, 3)
    assert sample_clients(plain, ids, 5, 7, 3) != sample_clients(plain, ids, 5, 7, 4)
    assert round_rng(plain, 7, 3).random() == round_rng(plain, 7, 3).random()
    # DP: 50 draws of a secret generator are not all equal, whatever seed the scenario names
    dp = _dp(population=20, expected_clients=5)
    assert len({round_rng(dp, 7, 3).random() for _ in range(50)}) == 50
    samples = {tuple(sample_clients(dp, ids, 5, 7, 3)) for _ in range(50)}
    assert len(samples) > 1


def test_plain_strategies_get_a_plain_rounds_defaults_from_the_loop_functions() -> None:
    state = ServerState.initial(np.ones(3, np.float32))
    for strategy in (FedAvg(), Scaffold(population=2), CenteredClipping()):
        assert epsilon(strategy, state) is None and not would_exceed_budget(strategy, state)
        assert round_metrics(strategy, state) == {} and skips_short_rounds(strategy)
        assert bind_cohort(strategy, 3) is strategy
        assert initial_state(strategy, state.params).round == 0
    dp = _dp(target_epsilon=0.01)
    fresh = initial_state(dp, np.zeros(2, np.float32))
    assert fresh.wrapper_state["dp"]["clip"] == 1.0 and epsilon(dp, fresh) == 0.0
    assert would_exceed_budget(dp, fresh) and not skips_short_rounds(dp)  # one round would pass 0.01
    assert bind_cohort(dp, 3).sampled == 3  # type: ignore[attr-defined]


def test_describe_records_the_settings_not_the_bound_per_round_values() -> None:
    bound = Scaffold(server_lr=0.5, population=4).for_round(ServerState.initial(np.ones(2, np.float32)))
    assert bound.control is not None
    assert describe(bound) == {"name": "scaffold", "server_lr": 0.5, "population": 4}
    cc = CenteredClipping(clip_radius=2.0).for_round(
        ServerState(params=np.zeros(2, np.float32), slots={"momentum": np.ones(2, np.float32)}))
    assert describe(cc) == {"name": "centered_clipping", "clip_radius": 2.0, "bucket_size": 2, "momentum": 0.9,
                            "server_lr": 1.0}
    assert describe(Krum(num_byzantine=1)) == {"name": "krum", "server_lr": 1.0, "num_byzantine": 1,
                                               "num_selected": 1}
    assert describe(FedAdagrad()) == {"name": "fedadagrad", "server_lr": 0.01, "beta1": 0.9, "tau": 1e-3}
    dp = describe(_dp(inner=FedProx(mu=0.5)))
    assert dp["inner"] == {"name": "fedprox", "server_lr": 1.0, "mu": 0.5} and dp["clip_norm"] == 1.0


def test_a_secure_sum_is_the_round_aggregate_for_a_mean_and_refused_for_a_rule_that_needs_every_update() -> None:
    partial = aggregate.MeanState(total=np.array([2.0, 4.0], np.float32), weight=2.0, count=2)
    folded = fold_secure_sum(FedAvg(), 2, partial)
    np.testing.assert_array_equal(aggregate.finalize(folded), [1.0, 2.0])
    for robust in (FedMedian(), CenteredClipping()):
        with pytest.raises(TypeError, match="needs every update"):
            fold_secure_sum(robust, 2, partial)


def test_only_centered_clipping_hands_dp_a_centred_term() -> None:
    assert isinstance(CenteredClipping(), CentredTerms)
    assert not [s for s in (FedAvg(), FedAvgM(), Scaffold(), FedMedian(), Krum()) if isinstance(s, CentredTerms)]
    # the mean strategies share one fold: a running weighted mean
    assert all(isinstance(s, MeanStrategy) for s in (FedAvg(), FedProx(), FedAvgM(), FedAdagrad(), Scaffold()))
