"""Scenario keys of robust aggregation and of the attack harness: parsed, validated, refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from aggregator.serverapp import build_strategy
from aggregator.strategies import CenteredClipping, FedMedian, FedTrimmedMean, Krum
from clients.attacks import AttackPlan
from scenarios.errors import ScenarioError
from scenarios.schema import load_scenario, scenario_from_dict
from scenarios.threats import ByzantineSpec

ROOT = Path(__file__).resolve().parents[2]


def parse(**sections: object):
    return scenario_from_dict({"name": "x", "federation": {"clients": 10}, **sections}, source="s.toml")


@pytest.mark.parametrize("name", ["centered_clipping", "median", "trimmed_mean", "krum"])
def test_robust_aggregator_with_secure_aggregation_is_refused_naming_both_keys(name: str) -> None:
    # Prepare / Execute
    with pytest.raises(ScenarioError) as error:
        parse(strategy={"name": name}, secagg={"enabled": True})

    # Assert
    message = str(error.value)
    assert message.startswith(f"s.toml: strategy.name = '{name}'") and "[secagg] enabled = true" in message


def test_attack_harness_with_secure_aggregation_is_refused_naming_both_keys() -> None:
    with pytest.raises(ScenarioError, match=r"faults.byzantine.attack = 'alie'.*\[secagg\] enabled = true"):
        parse(faults={"byzantine": {"fraction": 0.2, "attack": "alie"}}, secagg={"enabled": True})
    assert parse(faults={"byzantine": 0.2}, secagg={"enabled": True}).secagg.enabled  # corruptions still work


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "krum"])
def test_a_rank_based_robust_rule_with_dp_is_refused_with_the_reason(name: str) -> None:
    strategy = {"name": name, "num_byzantine": 1} if name == "krum" else {"name": name}
    with pytest.raises(ScenarioError, match=rf"strategy.name = '{name}'.*\[dp\] enabled = true.*centered_clipping"):
        parse(strategy=strategy, dp={"enabled": True, "noise_multiplier": 1.0})


def test_centered_clipping_composes_with_central_dp_without_buckets() -> None:
    # Prepare / Execute
    spec = parse(strategy={"name": "centered_clipping", "bucket_size": 1},
                 dp={"enabled": True, "noise_multiplier": 1.0})
    strategy = build_strategy(spec)

    # Assert: DP wraps the rule, which still decides each client's term
    assert strategy.name == "dp-fedavg" and isinstance(strategy.inner, CenteredClipping)
    with pytest.raises(ScenarioError, match=r"strategy\.centered_clipping\.bucket_size = 2.*\[dp\] enabled = true "
                                            r"needs bucket_size = 1"):
        parse(strategy={"name": "centered_clipping"}, dp={"enabled": True, "noise_multiplier": 1.0})


@pytest.mark.parametrize(("strategy", "key", "value"), [
    ({"name": "centered_clipping", "clip_radius": 0.0}, "strategy.clip_radius", "0.0"),
    ({"name": "centered_clipping", "bucket_size": 0}, "strategy.bucket_size", "0"),
    ({"name": "centered_clipping", "momentum": 1.0}, "strategy.momentum", "1.0"),
    ({"name": "trimmed_mean", "trim_fraction": 0.5}, "strategy.trim_fraction", "0.5"),
    ({"name": "krum", "num_byzantine": -1}, "strategy.num_byzantine", "-1"),
    ({"name": "krum", "num_byzantine": 4}, "strategy.krum.num_byzantine", "4"),  # 10 <= 2 * 4 + 2
    ({"name": "krum", "num_byzantine": 1, "num_selected": 10}, "strategy.krum.num_selected", "10"),
    ({"name": "krum", "krum": {"num_byzantine": 1, "num_selected": 10}}, "strategy.krum.num_selected", "10"),
    ({"name": "centered_clipping", "centered_clipping": {"clip_radius": 0.0}}, "strategy.centered_clipping.clip_radius",
     "0.0"),
    ({"name": "trimmed_mean", "trimmed_mean": {"trim_fraction": 0.5}}, "strategy.trimmed_mean.trim_fraction", "0.5"),
    ({"name": "bulyan"}, "strategy.name", "'bulyan'"),
])
def test_bad_robust_settings_name_the_key_and_value(strategy: dict, key: str, value: str) -> None:
    with pytest.raises(ScenarioError, match=f"{key} = {value}"):
        parse(strategy=strategy)


def test_byzantine_table_is_parsed_and_survives_a_round_trip() -> None:
    # Prepare / Execute
    scenario = parse(faults={"byzantine": {"fraction": 0.2, "attack": "ipm", "epsilon": 0.1}})
    again = scenario_from_dict(scenario.to_dict())

    # Assert
    assert scenario.faults.byzantine_spec == ByzantineSpec(fraction=0.2, attack="ipm", epsilon=0.1)
    assert again.faults == scenario.faults


def test_the_legacy_byzantine_fraction_and_kind_still_work() -> None:
    scenario = parse(faults={"byzantine": 0.5, "byzantine_kind": "wrong_shape"})
    assert scenario.faults.byzantine_spec == ByzantineSpec(fraction=0.5, attack="wrong_shape")


@pytest.mark.parametrize(("faults", "key", "value"), [
    ({"byzantine": {"fraction": 0.2, "attack": "bitflip"}}, "faults.byzantine.attack", "'bitflip'"),
    ({"byzantine": {"fraction": 1.0, "attack": "alie"}}, "faults.byzantine.fraction", "1.0"),
    ({"byzantine": {"fraction": 0.2, "attack": "alie", "z": -1}}, "faults.byzantine.z", "-1"),
    ({"byzantine": {"fraction": 0.2, "attack": "alie", "typo": 1}}, "faults.byzantine.typo", "1"),
    ({"byzantine": {"fraction": 0.2}, "byzantine_kind": "garbage"}, "faults.byzantine_kind", "'garbage'"),
    ({"byzantine": "alie"}, "faults.byzantine", "'alie'"),
    ({"byzantine": {"fraction": 0.2, "attack": "alie", "data": "shared"}}, "faults.byzantine.data", "'shared'"),
    ({"byzantine": {"fraction": 0.2, "attack": "nan", "data": "iid"}}, "faults.byzantine.data", "'iid'"),
])
def test_bad_byzantine_settings_name_the_key_and_value(faults: dict, key: str, value: str) -> None:
    with pytest.raises(ScenarioError, match=f"{key} = {value}"):
        parse(faults=faults)


def test_build_strategy_maps_the_keys() -> None:
    # Prepare / Execute
    cc = build_strategy(parse(strategy={"name": "centered_clipping", "clip_radius": 0.3, "bucket_size": 3,
                                        "momentum": 0.5}))
    krum = build_strategy(parse(strategy={"name": "krum", "num_byzantine": 2, "num_selected": 3}))

    # Assert
    assert cc == CenteredClipping(clip_radius=0.3, bucket_size=3, momentum=0.5)
    assert krum == Krum(num_byzantine=2, num_selected=3)
    assert build_strategy(parse(strategy={"name": "median"})) == FedMedian()
    assert build_strategy(parse(strategy={"name": "trimmed_mean", "trim_fraction": 0.1})) == FedTrimmedMean(beta=0.1)


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("byzantine-*.toml")), ids=lambda p: p.name)
def test_shipped_byzantine_scenarios_load(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.faults.byzantine_spec.fraction == 0.2 and scenario.faults.byzantine_spec.data == "iid"


@pytest.mark.parametrize(("sections", "culprit"), [
    ({"data": {"dataset": "synthetic"}}, "data.dataset = 'synthetic'"),
    ({"data": {"dataset": "mnist", "partition": "resample"}}, "data.partition = 'resample'"),
    ({"data": {"dataset": "file", "features": 4, "classes": 2}}, "data.path = ''"),
    ({"task": {"entry": "learning.tasks.regression:RegressionTask"}},
     "task.entry = 'learning.tasks.regression:RegressionTask'"),
])
def test_iid_attacker_data_needs_the_built_in_task_s_pooled_data(sections: dict, culprit: str) -> None:
    with pytest.raises(ScenarioError, match=rf"faults.byzantine.data = 'iid'.*{culprit}: IID attackers copy"):
        parse(**sections, faults={"byzantine": {"fraction": 0.2, "attack": "signflip", "data": "iid"}})


def test_iid_attacker_data_refuses_a_fraction_that_leaves_no_honest_client() -> None:
    with pytest.raises(ScenarioError, match=r"faults.byzantine.fraction = 0.75: of 2 clients leaves no honest"):
        parse(federation={"clients": 2}, faults={"byzantine": {"fraction": 0.75, "attack": "ipm", "data": "iid"}})


def test_iid_attacker_data_copies_at_the_attack_plan_s_clients() -> None:
    # Prepare / Execute
    scenario = parse(faults={"byzantine": {"fraction": 0.3, "attack": "signflip", "data": "iid"}})
    spec = scenario.faults.byzantine_spec

    # Assert: the copies are the clients the attack mod forges for, three of ten; "own" (the default) copies none
    assert spec.data == "iid" and spec.iid_copies(10, scenario.seed) == AttackPlan.from_scenario(scenario).attackers()
    assert len(spec.iid_copies(10, scenario.seed)) == 3
    assert ByzantineSpec(fraction=0.3, attack="signflip").iid_copies(10, scenario.seed) == ()
