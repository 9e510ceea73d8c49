"""Every setting a strategy accepts changes what it builds, and a key it would ignore is refused.

``scenarios.strategies.STRATEGY_SETTINGS`` says which keys each strategy reads
(its ``[strategy.<name>]`` table); the first tests hold it to ``build_strategy``
(a key that the strategy did not use would be a setting that changes nothing),
the others to the schema: a sub-table of another strategy, or a key of another
strategy, is refused by name; the flat keys of a file or stored run of before
the sub-tables still read; a scenario's ``to_dict`` reads back as itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
import typing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.serverapp import build_strategy
from aggregator.strategies import (
    CenteredClipping,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedMean,
    FedYogi,
    Krum,
    Scaffold,
)
from aggregator.strategies.registry import BUILDERS
from core.strategy import describe
from scenarios.errors import ScenarioError
from scenarios.schema import loads_scenario, scenario_from_dict
from scenarios.sections import StrategySpec
from scenarios.strategies import LEGACY_DEFAULTS, STRATEGY_SETTINGS, FedAdamSettings, setting_names
from tests.conftest import tiny_scenario

#: A valid value other than the default, per key.
CHANGED = {"server_lr": 0.5, "mu": 0.5, "momentum": 0.5, "beta1": 0.5, "beta2": 0.5, "tau": 0.5,
           "clip_radius": 0.5, "bucket_size": 3, "trim_fraction": 0.3, "num_byzantine": 1, "num_selected": 2}
NAMES = sorted(STRATEGY_SETTINGS)
FEDERATION = {"clients": 5}  # Krum with one Byzantine client needs more than 2 f + 2 = 4 per round

#: The strategy each name built at its defaults before the registry (describe() is compared on resume).
BEFORE = {
    "fedavg": FedAvg(server_lr=1.0), "fedprox": FedProx(server_lr=1.0, mu=0.01),
    "fedavgm": FedAvgM(server_lr=1.0, momentum=0.9),
    "fedadam": FedAdam(server_lr=1.0, beta1=0.9, beta2=0.99, tau=1e-3),
    "fedyogi": FedYogi(server_lr=1.0, beta1=0.9, beta2=0.99, tau=1e-3),
    "fedadagrad": FedAdagrad(server_lr=1.0, beta1=0.9, tau=1e-3),
    "scaffold": Scaffold(server_lr=1.0, population=5),
    "centered_clipping": CenteredClipping(clip_radius=1.0, bucket_size=2, momentum=0.9, server_lr=1.0),
    "median": FedMedian(server_lr=1.0), "trimmed_mean": FedTrimmedMean(server_lr=1.0, beta=0.2),
    "krum": Krum(server_lr=1.0, num_byzantine=0, num_selected=1),
}

#: A run stored before the sub-tables: every strategy's key, flat, at its default.
STORED = {"server_lr": 1.0, "momentum": 0.9, "beta1": 0.9, "beta2": 0.99, "tau": 0.001, "mu": 0.01,
          "clip_radius": 1.0, "bucket_size": 2, "trim_fraction": 0.2, "num_byzantine": 0, "num_selected": 1}


def sub_table(name: str, **keys: object) -> dict[str, object]:
    """``[strategy]`` with ``keys`` in ``[strategy.<name>]`` (``server_lr`` stays under ``[strategy]``)."""
    own = {k: v for k, v in keys.items() if k != "server_lr"}
    shared = {k: v for k, v in keys.items() if k == "server_lr"}
    return {"name": name, **shared, **({name: own} if own else {})}


def test_every_strategy_name_has_settings_and_a_builder() -> None:
    names = typing.get_args(typing.get_type_hints(StrategySpec)["name"])
    assert sorted(names) == NAMES == sorted(BUILDERS) == sorted(BEFORE)
    assert set(LEGACY_DEFAULTS) == set(STORED) - {"server_lr"}
    assert all(LEGACY_DEFAULTS[k] == STORED[k] for k in LEGACY_DEFAULTS)


@pytest.mark.parametrize("name", NAMES)
def test_each_strategy_builds_at_its_defaults_what_it_built_before(name: str) -> None:
    built = build_strategy(tiny_scenario(strategy={"name": name}, federation=FEDERATION))
    assert built == BEFORE[name] and describe(built) == describe(BEFORE[name])


@pytest.mark.parametrize(("name", "key"), sorted((n, k) for n in NAMES for k in (*setting_names(n), "server_lr")))
def test_each_setting_changes_the_strategy_built(name: str, key: str) -> None:
    default = build_strategy(tiny_scenario(strategy={"name": name}, federation=FEDERATION))
    changed = build_strategy(tiny_scenario(strategy=sub_table(name, **{key: CHANGED[key]}), federation=FEDERATION))
    assert vars(changed) != vars(default), f"{name}: {key} = {CHANGED[key]} built the same strategy"
    # the legacy flat form builds the same strategy
    flat = build_strategy(tiny_scenario(strategy={"name": name, key: CHANGED[key]}, federation=FEDERATION))
    assert flat == changed and describe(flat) == describe(changed)


@pytest.mark.parametrize(("name", "other"), [(n, o) for n in NAMES for o in NAMES if o != n])
def test_a_sub_table_of_another_strategy_is_refused(name: str, other: str) -> None:
    with pytest.raises(ScenarioError, match=rf"strategy\.{other} = .*strategy\.name = '{name}' would ignore"):
        tiny_scenario(strategy={"name": name, other: {}})


@pytest.mark.parametrize(("name", "key"), sorted((n, k) for n in NAMES for k in set(CHANGED) - set(setting_names(n))
                                                 - {"server_lr"}))
def test_a_key_of_another_strategy_in_the_sub_table_is_refused_by_name(name: str, key: str) -> None:
    with pytest.raises(ScenarioError, match=rf"strategy\.{name}\.{key} = .*not a setting of strategy '{name}'"):
        tiny_scenario(strategy={"name": name, name: {key: CHANGED[key]}})


@pytest.mark.parametrize(("name", "key"), sorted((n, k) for n in NAMES for k in set(CHANGED) - set(setting_names(n))
                                                 - {"server_lr"}))
def test_a_flat_key_the_strategy_would_ignore_is_refused_by_name(name: str, key: str) -> None:
    # the message lists the strategy's own keys, in [strategy.<name>] (none: "server_lr only")
    where = rf"\[strategy\.{name}\], {', '.join(setting_names(name))}" if setting_names(name) else "server_lr only"
    with pytest.raises(ScenarioError, match=rf"strategy\.{key} = .*not a setting of strategy '{name}'.*{where}"):
        tiny_scenario(strategy={"name": name, key: CHANGED[key]})


def test_the_sub_table_reads_from_toml_as_docs_strategies_shows_it() -> None:
    scenario = loads_scenario('[strategy]\nname = "fedadam"\nserver_lr = 0.01\n\n[strategy.fedadam]\nbeta1 = 0.8\n',
                              "doc.toml")
    assert scenario.strategy == StrategySpec(name="fedadam", server_lr=0.01, settings=FedAdamSettings(beta1=0.8))
    with pytest.raises(ScenarioError, match=r"doc\.toml: strategy\.fedyogi = \{'beta1': 0\.8\}: are the settings of "
                                            r"strategy 'fedyogi', and strategy\.name = 'fedadam' would ignore them"):
        loads_scenario('[strategy]\nname = "fedadam"\n[strategy.fedyogi]\nbeta1 = 0.8\n', "doc.toml")


def test_an_unknown_key_server_lr_in_the_table_and_a_key_set_twice_are_refused() -> None:
    with pytest.raises(ScenarioError, match=r"strategy\.fedadam\.beta3 = 0\.5: is not a setting of strategy"):
        tiny_scenario(strategy={"name": "fedadam", "fedadam": {"beta3": 0.5}})
    with pytest.raises(ScenarioError, match=r"strategy\.beta3 = 0\.5: unknown key"):
        tiny_scenario(strategy={"name": "fedadam", "beta3": 0.5})
    with pytest.raises(ScenarioError, match=r"strategy\.fedadam\.server_lr = 0\.5: is read by every strategy"):
        tiny_scenario(strategy={"name": "fedadam", "fedadam": {"server_lr": 0.5}})
    with pytest.raises(ScenarioError, match=r"strategy\.beta1 = 0\.5: is set in \[strategy\.fedadam\] too"):
        tiny_scenario(strategy={"name": "fedadam", "beta1": 0.5, "fedadam": {"beta1": 0.5}})
    with pytest.raises(ScenarioError, match=r"strategy\.fedadam = 0\.5: must be a table"):
        tiny_scenario(strategy={"name": "fedadam", "fedadam": 0.5})


def test_a_bad_value_is_named_where_it_was_written() -> None:
    with pytest.raises(ScenarioError, match=r"strategy\.fedadam\.beta1 = 1\.5: must be in \[0, 1\)"):
        tiny_scenario(strategy={"name": "fedadam", "fedadam": {"beta1": 1.5}})
    with pytest.raises(ScenarioError, match=r"strategy\.beta1 = 1\.5: must be in \[0, 1\)"):
        tiny_scenario(strategy={"name": "fedadam", "beta1": 1.5})


def test_an_ignored_key_at_its_default_is_accepted() -> None:
    # a run record (every key, defaults included) reads back; so does a file that spells out a default
    scenario = tiny_scenario(strategy={"name": "fedavg", "mu": 0.01, "beta1": 0.9, "bucket_size": 2})
    assert scenario.strategy == StrategySpec(name="fedavg")


@pytest.mark.parametrize("name", NAMES)
def test_a_stored_run_with_every_flat_key_at_its_default_loads(name: str) -> None:
    # Prepare: the scenario as a run stored it before the sub-tables (every key of every strategy, flat)
    raw = {**tiny_scenario(federation=FEDERATION).to_dict(), "strategy": {"name": name, **STORED}}

    # Execute
    scenario = scenario_from_dict(raw, source="run r1")

    # Assert: the strategy's defaults, and what it built before
    assert scenario.strategy == StrategySpec(name=name)
    assert scenario.strategy.settings == STRATEGY_SETTINGS[name]()
    assert describe(build_strategy(scenario)) == describe(BEFORE[name])


def test_the_scenario_of_a_store_written_before_the_sub_tables_reads_back() -> None:
    # Prepare: the run of tests/runstore/data/store-b1d2b18.db, read as it is stored (every flat key)
    path = Path(__file__).resolve().parents[1] / "runstore" / "data" / "store-b1d2b18.db"
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        (text,) = db.execute("SELECT scenario FROM runs").fetchone()
    stored = json.loads(text)
    assert set(stored["strategy"]) == {"name", *STORED}

    # Execute
    scenario = scenario_from_dict(stored, source="run of b1d2b18")

    # Assert: FedAvg as it was built, and the record of today's form reads back as the same scenario
    assert describe(build_strategy(scenario)) == describe(FedAvg(server_lr=stored["strategy"]["server_lr"]))
    assert scenario.to_dict()["strategy"] == {"name": "fedavg", "server_lr": 1.0}
    assert scenario_from_dict(scenario.to_dict(), source="record") == scenario


@pytest.mark.parametrize("name", NAMES)
def test_the_legacy_flat_form_reads_as_the_sub_table(name: str) -> None:
    keys = {k: CHANGED[k] for k in setting_names(name)}
    stored = {**STORED, "name": name, **keys, "server_lr": 0.5}  # a stored run of a changed setting
    flat = tiny_scenario(strategy=stored, federation=FEDERATION)
    table = tiny_scenario(strategy=sub_table(name, server_lr=0.5, **keys), federation=FEDERATION)
    assert flat == table
    assert dataclasses.asdict(table.strategy.settings) == {**dataclasses.asdict(STRATEGY_SETTINGS[name]()), **keys}


@pytest.mark.parametrize("name", NAMES)
def test_to_dict_writes_the_sub_table_and_reads_back_as_the_same_scenario(name: str) -> None:
    # Prepare
    keys = {k: CHANGED[k] for k in setting_names(name)}
    scenario = tiny_scenario(strategy={"name": name, **keys}, federation=FEDERATION)  # legacy flat

    # Execute
    raw = scenario.to_dict()

    # Assert: the new form, nothing flat but the shared keys; read back, the same scenario
    assert raw["strategy"] == {"name": name, "server_lr": 1.0, **({name: {**dataclasses.asdict(
        STRATEGY_SETTINGS[name]()), **keys}} if keys else {})}
    assert scenario_from_dict(raw, source="record") == scenario
    assert scenario_from_dict(scenario_from_dict(raw).to_dict()) == scenario


def test_a_spec_built_in_python_gets_its_strategys_defaults() -> None:
    assert StrategySpec(name="fedadam").settings == FedAdamSettings()
    with pytest.raises(TypeError):
        StrategySpec(name="fedavg", settings=FedAdamSettings(beta1=0.5))


_VALUES = st.one_of(st.integers(min_value=-(2**80), max_value=2**80), st.floats(allow_nan=True), st.text(max_size=8),
                    st.booleans(), st.lists(st.integers(), max_size=2), st.none())


@settings(max_examples=60, deadline=None)
@given(value=_VALUES)
def test_any_value_of_an_ignored_key_is_a_scenario_error_or_its_default(value: object) -> None:
    # huge integers, inf, NaN, strings, lists: the one answer is a ScenarioError naming the key, unless it
    # equals the default (then the strategy, which ignores it, builds as ever)
    try:
        scenario = tiny_scenario(strategy={"name": "fedavg", "beta1": value})
    except ScenarioError as exc:
        assert "strategy.beta1" in str(exc)
    else:
        assert value == 0.9 and describe(build_strategy(scenario)) == describe(BEFORE["fedavg"])


@settings(max_examples=60, deadline=None)
@given(value=_VALUES, flat=st.booleans())
def test_any_value_of_a_setting_is_a_scenario_error_naming_it_or_what_the_strategy_gets(value: object,
                                                                                       flat: bool) -> None:
    strategy = {"name": "fedadam", "beta1": value} if flat else {"name": "fedadam", "fedadam": {"beta1": value}}
    try:
        scenario = tiny_scenario(strategy=strategy)
    except ScenarioError as exc:
        assert ("strategy.beta1" if flat else "strategy.fedadam.beta1") in str(exc)
    else:
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1
        assert build_strategy(scenario) == FedAdam(server_lr=1.0, beta1=float(value), beta2=0.99, tau=1e-3)
