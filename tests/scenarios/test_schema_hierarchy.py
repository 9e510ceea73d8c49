"""``[hierarchy]`` and ``[federation] accumulate``: parsed, validated, and refused by name where a tree cannot
give flat FedAvg's model."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scenarios.errors import ScenarioError
from scenarios.schema import scenario_from_dict

CAPPED = {"clients": 10, "weighting": "capped"}


def parse(**sections: Any) -> Any:
    return scenario_from_dict({"name": "x", "federation": CAPPED, **sections}, source="s.toml")


def test_edges_default_to_a_flat_federation_and_read_back() -> None:
    assert not parse().hierarchy.enabled
    tree = parse(hierarchy={"edges": 5})
    assert tree.hierarchy.edges == 5 and tree.hierarchy.enabled
    assert scenario_from_dict(tree.to_dict(), source="again").hierarchy.edges == 5


def test_more_edges_than_devices_is_refused() -> None:
    with pytest.raises(ScenarioError, match=r"hierarchy.edges = 11: exceeds federation.clients = 10"):
        parse(hierarchy={"edges": 11})


@pytest.mark.parametrize(("sections", "match"), [
    ({"federation": {"clients": 10}}, r"federation.weighting = 'median': \[hierarchy\] edges > 0.*\"capped\""),
    ({"strategy": {"name": "krum", "num_byzantine": 1}},
     r"strategy.name = 'krum': \[hierarchy\] edges > 0 runs a robust rule at each edge.*num_byzantine bound"),
    ({"strategy": {"name": "centered_clipping"}},
     r"strategy.name = 'centered_clipping': .*previous round's aggregate"),
    ({"async": {"enabled": True}, "evaluation": {"federated": False}}, r"async.enabled = True: \[hierarchy\] edges"),
])
def test_what_a_tree_cannot_sum_is_refused_naming_both_keys(sections: dict[str, Any], match: str) -> None:
    with pytest.raises(ScenarioError, match=match):
        parse(hierarchy={"edges": 2}, **sections)
    parse(**sections)  # the same scenario flat is fine


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_a_stateless_robust_rule_runs_at_the_edges(rule: str) -> None:
    assert parse(hierarchy={"edges": 2}, strategy={"name": rule}).strategy.name == rule


def test_central_dp_over_a_tree_is_accepted() -> None:
    # every device weighs 1 and the top adds the noise: the edges' sums add up to the flat sum
    tree = parse(hierarchy={"edges": 2}, dp={"enabled": True, "noise_multiplier": 1.0, "clip_norm": 1.0})
    assert tree.dp.enabled and tree.hierarchy.edges == 2


def test_secure_aggregation_and_compression_compose_with_a_tree() -> None:
    tree = parse(hierarchy={"edges": 2}, secagg={"enabled": True}, compression={"randomk": 0.5})
    assert tree.secagg.enabled and tree.hierarchy.edges == 2


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True), st.booleans(),
                 st.text(max_size=8), st.none()))
def test_edges_is_a_whole_number_of_edges_or_refused_naming_the_key(value: Any) -> None:
    try:
        tree = parse(hierarchy={"edges": value})
    except ScenarioError as exc:
        assert "hierarchy.edges" in str(exc) and "\n" not in str(exc)
        return
    assert isinstance(tree.hierarchy.edges, int) and 0 <= tree.hierarchy.edges <= 10


def test_accumulate_is_float32_by_default_and_float64_when_asked() -> None:
    assert parse().federation.accumulate == "float32"
    assert parse(federation={**CAPPED, "accumulate": "float64"}).federation.accumulate == "float64"
    with pytest.raises(ScenarioError, match="federation.accumulate = 'float16'"):
        parse(federation={**CAPPED, "accumulate": "float16"})


@pytest.mark.parametrize(("sections", "key"), [
    ({"strategy": {"name": "median"}}, "strategy.name"),
    ({"async": {"enabled": True}, "evaluation": {"federated": False}}, "async.enabled"),
    ({"dp": {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 1.0}}, "dp.enabled"),
])
def test_float64_where_no_running_sum_is_kept_is_refused(sections: dict[str, Any], key: str) -> None:
    with pytest.raises(ScenarioError, match=rf"{key} = .*federation.accumulate = \"float64\""):
        parse(federation={**CAPPED, "accumulate": "float64"}, **sections)


def test_a_secure_sum_across_edges_needs_secagg_and_three_edges() -> None:
    ok = parse(hierarchy={"edges": 3, "secure_across_edges": True}, secagg={"enabled": True})
    assert ok.hierarchy.secure_across_edges
    with pytest.raises(ScenarioError, match=r"hierarchy.secure_across_edges = True: needs \[secagg\] enabled"):
        parse(hierarchy={"edges": 3, "secure_across_edges": True})
    with pytest.raises(ScenarioError, match=r"hierarchy.edges = 2: .* at least 3 edges"):
        parse(hierarchy={"edges": 2, "secure_across_edges": True}, secagg={"enabled": True})
    with pytest.raises(ScenarioError, match=r"hierarchy.secure_across_edges = True: needs edges > 0"):
        parse(hierarchy={"secure_across_edges": True}, secagg={"enabled": True})
