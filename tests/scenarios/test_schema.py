"""Scenario files: every shipped file parses; every bad value is named."""

from pathlib import Path

import pytest

from scenarios.errors import ScenarioError
from scenarios.schema import load_scenario, loads_scenario

SHIPPED = sorted((Path(__file__).resolve().parents[2] / "scenarios").glob("*.toml"))


def test_the_required_scenarios_ship() -> None:
    names = {p.stem for p in SHIPPED}
    assert {"quickstart", "fedavg-mnist-noniid", "fedprox-synthetic-fedavg",
            "fedprox-synthetic-fedprox", "dropouts"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_scenario_parses(path: Path) -> None:
    scenario = load_scenario(path)
    assert scenario.name == path.stem
    assert scenario.rounds > 0


def test_defaults_and_derived_values() -> None:
    s = loads_scenario("[federation]\nclients = 20\nfraction = 0.25\n", "x.toml")
    assert s.name == "x" and s.federation.per_round == 5 and s.strategy.name == "fedavg"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rounds = 0", "bad.toml: rounds = 0: must be > 0"),
        ("[data]\nalpha = -1", "bad.toml: data.alpha = -1.0: must be in (0, 1,000,000]"),
        ("[federation]\nclientz = 3", "bad.toml: federation.clientz = 3: unknown key; allowed: accumulate, clients,"),
        ("[model]\nname = 'resnet'", "bad.toml: model.name = 'resnet': must be one of 'logreg', 'mlp', 'cnn'"),
        ("seed = 'x'", "bad.toml: seed = 'x': must be an integer"),
        ("[training]\nlr = true", "bad.toml: training.lr = True: must be a number"),
        ("[faults]\ndropouts = { lunch = 0.1 }", "bad.toml: faults.dropouts.lunch = 0.1: unknown stage"),
        ("[faults]\ndropouts = { train = 1.5 }", "bad.toml: faults.dropouts.train = 1.5: must be in [0, 1)"),
        ("[federation]\nclients = 4\nmin_clients = 5", "bad.toml: federation.min_clients = 5: exceeds"),
        ("[dp]\nenabled = true", "bad.toml: dp.noise_multiplier = None: give noise_multiplier"),
        ("data = 3", "bad.toml: data = 3: must be a table"),
        ("rounds = [", "bad.toml: not valid TOML"),
        ("[secagg]\nclient_metrics = 'no'", "bad.toml: secagg.client_metrics = 'no': must be true or false"),
        ("[data]\npartition = 'resample'\nsamples_per_client = 0",
         "bad.toml: data.samples_per_client = 0: must be > 0"),
        ("[data]\ndataset = 'synthetic'\npartition = 'resample'",
         "bad.toml: data.partition = 'resample': does not apply to dataset = 'synthetic'"),
    ],
)
def test_bad_value_names_file_key_and_value(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        loads_scenario(text, "bad.toml")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read scenario file"):
        load_scenario(tmp_path / "nope.toml")


def test_overrides_are_validated_and_do_not_mutate() -> None:
    s = loads_scenario("rounds = 3", "x.toml")
    assert s.with_overrides(rounds=5).rounds == 5 and s.rounds == 3
    with pytest.raises(ScenarioError, match="rounds = -1"):
        s.with_overrides(rounds=-1)
