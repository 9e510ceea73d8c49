"""``[training] local_steps``: a positive integer, exclusive of an explicit ``local_epochs``, named in every error."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scenarios.errors import ScenarioError
from scenarios.schema import loads_scenario, scenario_from_dict
from scenarios.sections import MAX_LOCAL_STEPS


def _with_training(**training: Any) -> dict[str, Any]:
    return {"name": "steps", "training": training}


_BAD = st.one_of(
    st.integers(max_value=0),                                   # zero and negative
    st.integers(min_value=MAX_LOCAL_STEPS + 1),                 # huge, past 2^63 too
    st.floats(allow_nan=True, allow_infinity=True),             # 5.0 is not an integer either
    st.text(max_size=20),
    st.booleans(),                                              # true is not 1
    st.lists(st.integers(), max_size=3),
)


@settings(max_examples=150, deadline=None)
@given(value=_BAD)
def test_a_bad_local_steps_is_one_line_naming_the_key(value: Any) -> None:
    with pytest.raises(ScenarioError) as caught:
        scenario_from_dict(_with_training(local_steps=value), source="bad.toml")
    message = str(caught.value)
    assert message.startswith("bad.toml: training.local_steps = ") and "\n" not in message


@settings(max_examples=50, deadline=None)
@given(value=st.integers(min_value=1, max_value=MAX_LOCAL_STEPS))
def test_a_good_local_steps_is_kept_and_survives_the_round_trip(value: int) -> None:
    scenario = scenario_from_dict(_with_training(local_steps=value, batch_size=8))
    assert scenario.training.local_steps == scenario.training.steps == value
    assert "local_epochs" not in scenario.to_dict()["training"]
    assert scenario_from_dict(scenario.to_dict()) == scenario


@pytest.mark.parametrize(("text", "message"), [
    ("[training]\nlocal_steps = 0", "bad.toml: training.local_steps = 0: must be > 0"),
    ("[training]\nlocal_steps = -3", "bad.toml: training.local_steps = -3: must be > 0"),
    ("[training]\nlocal_steps = 2.5", "bad.toml: training.local_steps = 2.5: must be an integer"),
    ("[training]\nlocal_steps = true", "bad.toml: training.local_steps = True: must be an integer"),
    ("[training]\nlocal_steps = '10'", "bad.toml: training.local_steps = '10': must be an integer"),
    ("[training]\nlocal_steps = 1000001", "bad.toml: training.local_steps = 1000001: must be <= 1,000,000"),
    ("[training]\nlocal_steps = 99999999999999999999", "bad.toml: training.local_steps = 99999999999999999999: "
                                                        "is out of range (a 64-bit integer)"),
])
def test_bad_values_in_a_file(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        loads_scenario(text, source="bad.toml")


@pytest.mark.parametrize("epochs", [1, 3])
def test_local_steps_and_an_explicit_local_epochs_are_refused_naming_both(epochs: int) -> None:
    with pytest.raises(ScenarioError) as caught:
        loads_scenario(f"[training]\nlocal_epochs = {epochs}\nlocal_steps = 20", source="both.toml")
    assert str(caught.value).startswith(f"both.toml: training.local_steps = 20: training.local_epochs = {epochs} "
                                        "is set too")


def test_without_local_steps_epochs_stay_as_they_were() -> None:
    scenario = loads_scenario("[training]\nlocal_epochs = 3", source="epochs.toml")
    assert (scenario.training.local_epochs, scenario.training.local_steps, scenario.training.steps) == (3, None, 0)
    assert scenario.to_dict()["training"]["local_epochs"] == 3
    assert scenario_from_dict(scenario.to_dict()) == scenario


def test_local_steps_with_dp_sgd_is_refused_naming_both() -> None:
    text = "[training]\nlocal_steps = 20\n[dp]\nlocal_dp_sgd = true\nnoise_multiplier = 1.0"
    with pytest.raises(ScenarioError, match=r"training.local_steps = 20: dp.local_dp_sgd = true"):
        loads_scenario(text, source="dpsgd.toml")
