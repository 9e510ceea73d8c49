"""Every ``[strategy]`` key a strategy accepts changes what it builds, and a key it would ignore is refused.

``scenarios.sections.STRATEGY_KEYS`` says which keys each strategy reads; the
first test holds it to ``build_strategy`` (a listed key that the strategy did
not use would be a setting that changes nothing), the others to the schema.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.serverapp import build_strategy
from core.strategy import describe
from scenarios.errors import ScenarioError
from scenarios.sections import STRATEGY_KEYS
from tests.conftest import tiny_scenario

#: A valid value other than the default, per key.
CHANGED = {"server_lr": 0.5, "mu": 0.5, "momentum": 0.5, "beta1": 0.5, "beta2": 0.5, "tau": 0.5,
           "clip_radius": 0.5, "bucket_size": 3, "trim_fraction": 0.3, "num_byzantine": 1, "num_selected": 2}


@pytest.mark.parametrize(("name", "key"), sorted((n, k) for n, keys in STRATEGY_KEYS.items()
                                                 for k in keys | {"server_lr"}))
def test_each_listed_key_changes_the_strategy_built(name: str, key: str) -> None:
    federation = {"clients": 5}  # Krum with one Byzantine client needs more than 2 f + 2 = 4 per round
    default = build_strategy(tiny_scenario(strategy={"name": name}, federation=federation))
    changed = build_strategy(tiny_scenario(strategy={"name": name, key: CHANGED[key]}, federation=federation))
    assert vars(changed) != vars(default), f"{name}: {key} = {CHANGED[key]} built the same strategy"


@pytest.mark.parametrize(("name", "key"), sorted((n, k) for n, keys in STRATEGY_KEYS.items()
                                                 for k in set(CHANGED) - keys - {"server_lr"}))
def test_a_key_the_strategy_would_ignore_is_refused_by_name(name: str, key: str) -> None:
    with pytest.raises(ScenarioError, match=rf"strategy\.{key}.*not a setting of strategy '{name}'"):
        tiny_scenario(strategy={"name": name, key: CHANGED[key]})


def test_an_ignored_key_at_its_default_is_accepted() -> None:
    # a run record (every key, defaults included) reads back; so does a file that spells out a default
    scenario = tiny_scenario(strategy={"name": "fedavg", "mu": 0.01, "beta1": 0.9})
    assert scenario.strategy.name == "fedavg"


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.integers(min_value=-(2**80), max_value=2**80), st.floats(allow_nan=True),
                       st.text(max_size=8), st.booleans(), st.lists(st.integers(), max_size=2), st.none()))
def test_any_value_of_an_ignored_key_is_a_scenario_error_or_its_default(value: object) -> None:
    # huge integers, inf, NaN, strings, lists: the one answer is a ScenarioError naming the key, unless it
    # equals the default (then the strategy, which ignores it, builds as ever)
    try:
        scenario = tiny_scenario(strategy={"name": "fedavg", "beta1": value})
    except ScenarioError as exc:
        assert "strategy.beta1" in str(exc)
    else:
        assert scenario.strategy.beta1 == 0.9 and describe(build_strategy(scenario))["name"] == "fedavg"
