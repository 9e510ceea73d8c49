"""The scenario loader against hostile input: a named one-line error, never another exception."""

from __future__ import annotations

import contextlib
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scenarios.errors import ScenarioError
from scenarios.schema import load_scenario, loads_scenario, scenario_from_dict


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("seed = -1", "bad.toml: seed = -1: must be >= 0"),
        ("seed = 9223372036854775808", "bad.toml: seed = 9223372036854775808: is out of range (a 64-bit integer)"),
        ("rounds = 100000000000000000000", "bad.toml: rounds = 100000000000000000000: is out of range"),
        ("rounds = 2000000", "bad.toml: rounds = 2000000: must be <= 1,000,000"),
        ("[training]\nlr = inf", "bad.toml: training.lr = inf: must be a finite number"),
        ("[training]\nlr = nan", "bad.toml: training.lr = nan: must be a finite number"),
        ("[training]\nlr = 1" + "0" * 400, "bad.toml: training.lr = 1000"),
        ("[federation]\ndeadline_s = inf", "bad.toml: federation.deadline_s = inf: must be a finite number"),
        ("[federation]\nmax_update_mb = inf", "bad.toml: federation.max_update_mb = inf: must be a finite"),
        ("[training]\nbatch_size = 1000000000000000000", "bad.toml: training.batch_size = 1000000000000000000: "
                                                         "must be <= 1,000,000"),
        ("[training]\nbatch_size = 1e18", "bad.toml: training.batch_size = 1e+18: must be an integer"),
        ("[data]\nclient_test_fraction = 1.0", "bad.toml: data.client_test_fraction = 1.0: must be in [0, 1)"),
        ("[secagg]\nbits = 32.0", "bad.toml: secagg.bits = 32.0: must be one of 16, 32, 64"),
        ("[federation]\nweighting = 'biggest'", "bad.toml: federation.weighting = 'biggest': must be one of"),
        ("[federation]\nmedian_cap = 0.5", "bad.toml: federation.median_cap = 0.5: must be >= 1"),
        ("[federation]\nmax_examples = 0", "bad.toml: federation.max_examples = 0: must be > 0"),
        ("[federation]\nmax_update_ratio = -1", "bad.toml: federation.max_update_ratio = -1.0: must be > 0"),
    ],
)
def test_hostile_values_are_one_named_line(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        loads_scenario(text, "bad.toml")
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_a_float_field_holding_an_integer_beyond_1e308_is_named() -> None:
    with pytest.raises(ScenarioError, match=r"training.lr = .*: is out of range \(too large for a float\)"):
        loads_scenario("[training]\nlr = 1" + "0" * 400, "bad.toml")


def test_a_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes("name = 'caf\u00e9'\n".encode("latin-1"))
    with pytest.raises(ScenarioError, match="latin1.toml: not UTF-8 text"):
        load_scenario(path)


def test_weighting_defaults_are_the_safe_ones() -> None:
    fed = loads_scenario("", "x.toml").federation
    assert (fed.weighting, fed.median_cap, fed.max_examples, fed.max_update_ratio) == ("median", 3.0, 100_000, 10.0)


# -- property-based -------------------------------------------------------------------------
_KEYS = {
    "": ["seed", "rounds", "name", "description"],
    "data": ["dataset", "partition", "alpha", "shards_per_client", "samples_per_client", "client_test_fraction",
             "server_test_fraction"],
    "federation": ["clients", "fraction", "clients_per_round", "min_clients", "deadline_s", "max_update_mb",
                   "weighting", "median_cap", "max_examples", "max_update_ratio"],
    "training": ["local_epochs", "batch_size", "lr", "momentum"],
    "strategy": ["name", "server_lr", "momentum", "beta1", "tau"],
    "evaluation": ["federated", "every", "clients"],
    "secagg": ["enabled", "threshold", "bits", "degree", "max_weight", "clip_range", "stage_timeout_s"],
    "dp": ["enabled", "clip_norm", "noise_multiplier", "delta", "target_epsilon", "clip_lr", "count_noise_multiplier",
           "local_noise_multiplier", "local_max_grad_norm"],
    "faults": ["dropouts", "stragglers", "straggler_delay_s", "byzantine"],
    "async": ["enabled", "concurrency", "buffer_size", "max_staleness", "base_time_s", "straggler_factor"],
    "compression": ["bits", "topk", "randomk", "error_feedback", "downlink_bits"],
}
_values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from([2**63, 2**63 - 1, -1, 0, 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.text(max_size=8), st.none(),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=6), st.floats(), max_size=2))


@st.composite
def _mutations(draw) -> dict:
    raw: dict = {"name": "fuzz"}
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(sorted(_KEYS)))
        key = draw(st.sampled_from(_KEYS[section]) | st.text(min_size=1, max_size=6))
        value = draw(_values)
        if section:
            raw.setdefault(section, {})[key] = value
        else:
            raw[key] = value
    return raw


@settings(max_examples=200, deadline=None)
@given(_mutations())
def test_any_mutated_scenario_is_valid_or_a_named_error(raw: dict) -> None:
    try:
        scenario = scenario_from_dict(raw, source="fuzz.toml")
    except ScenarioError as exc:
        assert str(exc).startswith("fuzz.toml: ") and "\n" not in str(exc)
        return
    # Accepted: every number is one a run and the store can hold
    assert 0 <= scenario.seed < 2**63 and 1 <= scenario.rounds <= 1_000_000
    assert math.isfinite(scenario.training.lr) and math.isfinite(scenario.federation.deadline_s)
    assert scenario.data.client_test_fraction < 1
    assert 1 <= scenario.data.samples_per_client <= 1_000_000 and type(scenario.data.samples_per_client) is int
    cx = scenario.compression  # a codec the round can build: an accepted setting never fails mid-run
    assert (1 <= cx.bits <= 16 or cx.bits == 32) and 0 <= cx.topk <= 1 and 0 <= cx.randomk <= 1
    assert not (cx.topk and cx.randomk) and cx.downlink_bits in (8, 16, 32)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_on_disk_are_a_scenario_or_a_named_error(tmp_path_factory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.toml"
    path.write_bytes(data)
    try:
        load_scenario(path)
    except ScenarioError as exc:
        assert str(exc).startswith(str(path)) and "\n" not in str(exc)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["seed", "rounds", "training.lr", "training.batch_size", "federation.deadline_s",
                        "federation.max_update_mb", "federation.clients", "data.alpha"]),
       st.sampled_from(["inf", "-inf", "nan", "1e400", "1" + "0" * 400, "9223372036854775808", "-1", "0",
                        "1.0", "'x'", "true", "[1]", "{a = 1}", "1" + "0" * 5000]))
def test_any_toml_value_in_any_number_field_is_valid_or_named(key: str, literal: str) -> None:
    section, _, name = key.rpartition(".")
    text = (f"[{section}]\n" if section else "") + f"{name} = {literal}\n"
    with contextlib.suppress(tomllib.TOMLDecodeError, ValueError):  # the loader must still answer with a ScenarioError
        tomllib.loads(text)
    try:
        loads_scenario(text, "v.toml")
    except ScenarioError as exc:
        assert str(exc).startswith("v.toml: ") and "\n" not in str(exc)


@settings(max_examples=200, deadline=None)
@given(st.fixed_dictionaries({}, optional={"fraction": _values,
                                           "attack": st.sampled_from(["signflip", "nan"]) | _values,
                                           "data": st.sampled_from(["iid", "own"]) | _values}),
       st.sampled_from(["digits", "synthetic"]), st.integers(1, 6) | _values)
def test_any_byzantine_table_is_valid_or_a_named_error(table: dict, dataset: str, clients: object) -> None:
    try:
        raw = {"name": "fuzz", "data": {"dataset": dataset}, "federation": {"clients": clients},
               "faults": {"byzantine": table}}
        scenario = scenario_from_dict(raw, source="fuzz.toml")
    except ScenarioError as exc:
        assert str(exc).startswith("fuzz.toml: ") and "\n" not in str(exc)
        return
    # Accepted: IID copies only on a pooled data set, and at least one honest client to split it
    spec, n = scenario.faults.byzantine_spec, scenario.federation.clients
    copies = spec.iid_copies(n, scenario.seed)
    assert 0 <= spec.fraction < 1 and len(copies) < n and all(0 <= c < n for c in copies)
    assert not copies or (spec.data == "iid" and dataset == "digits")

