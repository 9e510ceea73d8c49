"""Every numeric setting of a scenario has a range from its meaning (issue 47, item 4).

Huge, infinite, NaN, negative, zero and non-numeric values in every numeric
key are refused in one line naming the key, or accepted inside the key's
range; what an accepted setting drives (the adaptive server optimisers, DP's
noise and clip, the secure-aggregation grid) then computes finite numbers.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.strategies.registry import build_base
from core.strategy import ServerState
from scenarios.errors import ScenarioError
from scenarios.schema import loads_scenario, scenario_from_dict
from scenarios.strategies import STRATEGY_SETTINGS

# -- every numeric setting has a range from its meaning (issue 47, item 4) ---------------------------------
#: Each numeric key -> the values a scenario may hold: intervals joined by "|"; "whole" asks a whole number.
RANGES = {
    "seed": "[0, 9223372036854775807]", "rounds": "[1, 1e6]",
    "data.alpha": "(0, 1e6]", "data.shards_per_client": "[1, 1e4]", "data.samples_per_client": "[1, 1e6]",
    "data.server_test_fraction": "[0, 1)", "data.client_test_fraction": "[0, 1)",
    "data.synthetic_alpha": "[0, 100]", "data.synthetic_beta": "[0, 100]", "data.features": "[0, 1e7]",
    "data.classes": "[0, 1e5]",
    "federation.clients": "[1, 1e6]", "federation.fraction": "(0, 1]", "federation.clients_per_round": "[0, 10]",
    "federation.min_clients": "[1, 10]", "federation.deadline_s": "(0, 604800]",
    "federation.max_update_mb": "(0, 65536]", "federation.median_cap": "[1, 1e6]",
    "federation.max_examples": "[1, 1e9]", "federation.max_update_ratio": "(0, 1e6]",
    "training.local_epochs": "[1, 1e4]", "training.batch_size": "[1, 1e6]", "training.lr": "(0, 100]",
    "training.momentum": "[0, 1)", "training.local_steps": "[1, 1e6]",
    "strategy.server_lr": "(0, 100]", "strategy.fedprox.mu": "[0, 1e4]", "strategy.fedavgm.momentum": "[0, 1)",
    "strategy.fedadam.beta1": "[0, 1)", "strategy.fedadam.beta2": "[0, 1)", "strategy.fedadam.tau": "[1e-10, 1]",
    "strategy.fedyogi.tau": "[1e-10, 1]", "strategy.fedadagrad.beta1": "[0, 1)",
    "strategy.fedadagrad.tau": "[1e-10, 1]", "strategy.centered_clipping.clip_radius": "(0, 1e6]",
    "strategy.centered_clipping.bucket_size": "[1, 1e6]", "strategy.centered_clipping.momentum": "[0, 1)",
    "strategy.trimmed_mean.trim_fraction": "[0, 0.5)", "strategy.krum.num_byzantine": "[0, 3]",
    "strategy.krum.num_selected": "[1, 10]",
    "evaluation.every": "[1, 1e6]", "evaluation.fraction": "(0, 1]", "evaluation.min_clients": "[1, 1e6]",
    "async.concurrency": "[1, 1e6]", "async.buffer_size": "[1, 1e6]", "async.max_staleness": "[0, 1e6]",
    "async.base_time_s": "(0, 1e9]", "async.speed_sigma": "[0, 5]", "async.jitter_sigma": "[0, 5]",
    "async.stragglers": "[0, 1)", "async.straggler_factor": "[1, 1e6]",
    "faults.dropouts.train": "[0, 1)", "faults.stragglers": "[0, 1)", "faults.straggler_delay_s": "[0, 604800]",
    "faults.edges": "[0, 1)",
    "faults.byzantine": "[0, 1)", "faults.byzantine.fraction": "[0, 1)", "faults.byzantine.scale": "(0, 1e6]",
    "faults.byzantine.epsilon": "(0, 1e6]", "faults.byzantine.z": "(0, 100]",
    "faults.byzantine.inflated_examples": "[1, 1e9]",
    "secagg.threshold": "[0, 1)|whole[2, 1e6]", "secagg.degree": "[0, 0]|[2, 1e6]",
    "secagg.clip_range": "[1e-6, 1e6]", "secagg.max_weight": "(0, 1e9]", "secagg.stage_timeout_s": "(0, 604800]",
    "dp.clip_norm": "(0, 1e6]", "dp.noise_multiplier": "[0, 0]|[1e-3, 1e3]", "dp.target_epsilon": "(0, 1e3]",
    "dp.delta": "(0, 1)", "dp.target_quantile": "(0, 1)", "dp.clip_lr": "(0, 10]",
    "dp.count_noise_multiplier": "[1e-3, 1e6]", "dp.local_noise_multiplier": "[0, 0]|[1e-3, 1e3]",
    "dp.local_max_grad_norm": "(0, 1e6]",
    "compression.bits": "whole[1, 16]|whole[32, 32]", "compression.topk": "[0, 1]", "compression.randomk": "[0, 1]",
}
#: Keys whose value must be an integer (the rest take any finite number).
INTEGER_KEYS = {"seed", "rounds", "data.shards_per_client", "data.samples_per_client", "data.features",
                "data.classes", "federation.clients", "federation.clients_per_round", "federation.min_clients",
                "federation.max_examples", "training.local_epochs", "training.batch_size", "training.local_steps",
                "strategy.centered_clipping.bucket_size", "strategy.krum.num_byzantine",
                "strategy.krum.num_selected", "evaluation.every", "evaluation.min_clients", "async.concurrency",
                "async.buffer_size", "async.max_staleness", "faults.byzantine.inflated_examples", "secagg.degree",
                "compression.bits"}
#: Huge, infinite, NaN, negative, zero, tiny, just-past-a-bound, and not numbers at all.
HOSTILE = [1e308, -1e308, 2**70, -(2**70), 2**63, math.inf, -math.inf, math.nan, -1, -1e-300, 0, 0.0, 1e-300,
           1e-11, 1e-7, 0.5, 1, 1.5, 2, 99.5, 101, 10_001, 1_000_001, 10**9 + 1, 604_801, "x", "1", True, False,
           [1], {"a": 1}]


def _inside(ranges: str, value: float) -> bool:
    """Whether ``value`` lies in one of the intervals written in ``ranges`` ("[0, 1)|whole[2, 1e6]")."""
    for part in ranges.split("|"):
        whole = part.startswith("whole")
        text = part.removeprefix("whole")
        low, high = (float(x) for x in text[1:-1].split(","))
        above = value > low if text[0] == "(" else value >= low
        below = value < high if text[-1] == ")" else value <= high
        if above and below and (not whole or float(value).is_integer()):
            return True
    return False


def _raw(key: str, value: object) -> dict:
    """A scenario holding ``value`` at ``key``; a strategy's own key names its strategy."""
    raw: dict = {"name": "fuzz"}
    *path, last = key.split(".")
    table = raw
    for part in path:
        table = table.setdefault(part, {})
    table[last] = value
    if len(path) == 2 and path[0] == "strategy":
        raw["strategy"]["name"] = path[1]
    return raw


def _read(scenario: object, key: str) -> object:
    """The value the scenario holds at ``key``, wherever the schema keeps it."""
    *path, last = key.replace("async", "asynchronous").split(".")
    node = scenario
    for part in path:
        node = (node.settings if part in STRATEGY_SETTINGS else node.byzantine_spec if part == "byzantine"
                else getattr(node, part))
    if last == "byzantine":
        return node.byzantine_spec.fraction
    return node[last] if isinstance(node, dict) else getattr(node, last)


def _assert_in_range_or_named(key: str, value: object) -> None:
    try:
        scenario = scenario_from_dict(_raw(key, value), source="fuzz.toml")
    except ScenarioError as exc:  # refused: one line naming the key (or a key of the table written there)
        named = str(exc).startswith((f"fuzz.toml: {key} = ", f"fuzz.toml: {key}."))
        assert named and "\n" not in str(exc), (key, value, str(exc))
        return
    held = _read(scenario, key)  # accepted: a number of the key's range, of the key's type
    assert _inside(RANGES[key], held), (key, value, held)
    kinds = (int,) if key in INTEGER_KEYS else (int, float) if key.startswith("faults.dropouts.") else (float,)
    assert type(held) in kinds, (key, value, held)  # a dropout fraction is kept as written (a table of numbers)


def test_every_numeric_setting_refuses_hostile_values_by_name() -> None:
    # Prepare / Execute / Assert: every key against every hostile value (1e308 is refused by all but none)
    for key in RANGES:
        for value in HOSTILE:
            _assert_in_range_or_named(key, value)


@pytest.mark.parametrize("key", sorted(RANGES))
@settings(max_examples=25, deadline=None)
@given(value=st.floats() | st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(HOSTILE))
def test_any_number_in_any_numeric_setting_is_in_its_range_or_named(key: str, value: object) -> None:
    _assert_in_range_or_named(key, value)


@pytest.mark.parametrize(("text", "message"), [
    ("[strategy]\nname = 'fedadam'\n[strategy.fedadam]\ntau = 1e308", "strategy.fedadam.tau = 1e+308: must be in "
                                                                       "[1e-10, 1]"),
    ("[strategy]\nname = 'fedadam'\n[strategy.fedadam]\ntau = 0.0", "strategy.fedadam.tau = 0.0: must be in "
                                                                    "[1e-10, 1]"),
    ("[strategy]\nserver_lr = 1e3", "strategy.server_lr = 1000.0: must be in (0, 100]"),
    ("[strategy]\nname = 'fedprox'\n[strategy.fedprox]\nmu = 1e5", "strategy.fedprox.mu = 100000.0: must be in "
                                                                   "[0, 10,000]"),
    ("[faults]\nstraggler_delay_s = 1e308", "faults.straggler_delay_s = 1e+308: must be in [0, 604,800]"),
    ("[secagg]\nthreshold = 1.0", "secagg.threshold = 1.0: must be 0 (a strict majority), a fraction in (0, 1) "
                                  "or a whole number of clients in [2, 1,000,000]"),
    ("[secagg]\ndegree = 1", "secagg.degree = 1: must be 0 or in [2, 1,000,000]"),
    ("[secagg]\nstage_timeout_s = 1e308", "secagg.stage_timeout_s = 1e+308: must be in (0, 604,800]"),
    ("[dp]\nnoise_multiplier = 1e-200", "dp.noise_multiplier = 1e-200: must be 0 or in [0.001, 1,000]"),
    ("[dp]\nclip_lr = 1e308", "dp.clip_lr = 1e+308: must be in (0, 10]"),
    ("[dp]\nadaptive_clipping = true\nnoise_multiplier = 1.0\ncount_noise_multiplier = 0.5",
     "dp.count_noise_multiplier = 0.5: must exceed noise_multiplier / 2 = 0.5"),
    ("[dp]\nlocal_max_grad_norm = -1.0", "dp.local_max_grad_norm = -1.0: must be in (0, 1,000,000]"),
])
def test_an_out_of_range_setting_is_one_line_with_its_range(text: str, message: str) -> None:
    with pytest.raises(ScenarioError) as info:
        loads_scenario(text, "bad.toml")
    assert str(info.value).startswith(f"bad.toml: {message}"), str(info.value)


# -- accepted settings compute finite numbers -----------------------------------------------------------------
@pytest.mark.parametrize(("tau", "expected"), [
    # m = 0.1 d; v = 0.99 tau^2 + 0.01 d^2; x = 100 m / (sqrt(v) + tau), with d = (1, -1):
    (1.0, 5.0),          # v = 1, x = 100 x 0.1 / 2 = 5
    (1e-10, 100.0),      # v = 0.01, x = 100 x 0.1 / (0.1 + 1e-10) = 100 (to float32)
])
def test_fedadam_at_its_largest_server_lr_takes_the_step_worked_by_hand(tau: float, expected: float) -> None:
    # Prepare: the largest server_lr, and the largest and smallest tau the schema accepts
    scenario = scenario_from_dict({"name": "x", "strategy": {"name": "fedadam", "server_lr": 100.0,
                                                             "fedadam": {"tau": tau}}}, source="x.toml")
    strategy = build_base(scenario)

    # Execute
    state = strategy.apply(ServerState.initial(np.zeros(2, np.float32)), np.array([1.0, -1.0], np.float32))

    # Assert: the step; and one past each end of the ranges is refused
    np.testing.assert_allclose(state.params, [expected, -expected], rtol=1e-5)
    for table in ({"server_lr": 100.001}, {"fedadam": {"tau": tau * (1.001 if tau == 1.0 else 0.999)}}):
        with pytest.raises(ScenarioError, match=r"^x\.toml: strategy\.(fedadam\.tau|server_lr) = .*: must be in"):
            scenario_from_dict({"name": "x", "strategy": {"name": "fedadam", **table}}, source="x.toml")


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["fedadam", "fedyogi", "fedadagrad"]),
       table=st.fixed_dictionaries({}, optional={k: st.floats(0, 1) | st.floats() | st.sampled_from(HOSTILE)
                                                 for k in ("tau", "beta1", "beta2")}),
       server_lr=st.floats(0, 100) | st.floats() | st.sampled_from([100.0, 1e-300, 1e308]),
       deltas=st.lists(st.lists(st.floats(-1e3, 1e3, width=32) | st.sampled_from([1e-30, -1e-30, 0.0]),
                                min_size=3, max_size=3), min_size=1, max_size=5))
def test_an_accepted_adaptive_optimiser_takes_finite_steps(name: str, table: dict, server_lr: float,
                                                           deltas: list[list[float]]) -> None:
    if name == "fedadagrad":
        table.pop("beta2", None)
    try:
        scenario = scenario_from_dict({"name": "x", "strategy": {"name": name, "server_lr": server_lr,
                                                                 name: table}}, source="x.toml")
    except ScenarioError as exc:
        assert str(exc).startswith("x.toml: strategy.") and "\n" not in str(exc)
        return
    strategy = build_base(scenario)
    state = ServerState.initial(np.zeros(3, np.float32))
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # an overflow or a NaN fails the test
        for delta in deltas:
            state = strategy.apply(state, np.array(delta, np.float32))
    assert np.isfinite(state.params).all() and np.isfinite(state.slots["v"]).all()


_DP_KEYS = ("clip_norm", "noise_multiplier", "target_epsilon", "delta", "clip_lr", "count_noise_multiplier",
            "target_quantile")


@settings(max_examples=60, deadline=None)
@given(table=st.fixed_dictionaries({}, optional={k: st.sampled_from([1e-3, 0.5, 1.0, 10.0, 1e3, 1e6]) | st.floats()
                                                 | st.sampled_from(HOSTILE) for k in _DP_KEYS}),
       adaptive=st.booleans())
def test_an_accepted_dp_table_builds_its_strategy_or_is_a_named_error(table: dict, adaptive: bool) -> None:
    from privacy.dp.build import make_dp_strategy
    from privacy.dp.errors import DPConfigError

    raw = {"enabled": True, "adaptive_clipping": adaptive, **table}
    raw.setdefault("noise_multiplier", None if "target_epsilon" in raw else 1.0)  # z derived from the budget
    try:
        spec = scenario_from_dict({"name": "x", "dp": raw}, source="x.toml").dp
    except ScenarioError as exc:
        assert str(exc).startswith("x.toml: dp.") and "\n" not in str(exc)
        return
    try:  # what is known only with the federation (sigma_b against a derived z) is a named error, never overflow
        dp = make_dp_strategy(build_base(scenario_from_dict({"name": "x"})), spec, clients_per_round=10,
                              population=100, rounds=10)
    except DPConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert math.isfinite(dp.update_noise_multiplier) and math.isfinite(dp.clip_norm)


@settings(max_examples=100, deadline=None)
@given(table=st.fixed_dictionaries({}, optional={
    "threshold": st.sampled_from([0, 0.6, 0.99, 2, 3.0, 1e6]) | st.floats() | st.sampled_from(HOSTILE),
    "degree": st.sampled_from([0, 2, 9, 10**6]) | st.integers() | st.sampled_from(HOSTILE),
    "clip_range": st.sampled_from([1e-6, 8.0, 1e6]) | st.floats() | st.sampled_from(HOSTILE),
    "max_weight": st.sampled_from([1e-300, 1.0, 1e9]) | st.floats() | st.sampled_from(HOSTILE),
    "stage_timeout_s": st.sampled_from([1e-300, 30.0, 604_800.0]) | st.floats() | st.sampled_from(HOSTILE),
    "bits": st.sampled_from([16, 32, 64])}))
def test_an_accepted_secagg_table_makes_a_protocol_config_with_a_finite_grid(table: dict) -> None:
    from privacy.secagg.quantize import Quantizer
    from privacy.secagg.train import config_from_spec

    try:
        spec = scenario_from_dict({"name": "x", "secagg": {"threat_model": "semi-honest", **table}},
                                  source="x.toml").secagg
    except ScenarioError as exc:
        assert str(exc).startswith("x.toml: secagg.") and "\n" not in str(exc)
        return
    config = config_from_spec(spec)  # the protocol's own checks agree with the scenario's
    grid = Quantizer(config.bits, config.clip_range, 10)
    assert math.isfinite(grid.scale) and grid.scale > 0 and 0 < config.stage_timeout_s <= 604_800
