"""Secure aggregation through the real round loop: same model quality, rounds survive dropouts."""

from __future__ import annotations

import pytest

from privacy.secagg.train import config_from_spec
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
from scenarios.schema import load_scenario
from tests.conftest import REPO, tiny_scenario

SCENARIOS = REPO / "scenarios"


def test_secure_aggregation_matches_plain_fedavg_accuracy(db_url: str) -> None:
    # The quickstart federation (20 clients, 10 a round); logistic regression stands in for its CNN: the
    # claim is about the aggregation (masking, quantisation, unmasking), not the model.
    quickstart = load_scenario(SCENARIOS / "quickstart.toml")
    plain = quickstart.with_overrides(rounds=4, model={**quickstart.to_dict()["model"], "name": "logreg"})
    secure = plain.with_overrides(secagg={"enabled": True, "max_weight": 1000.0})
    a = simulate(plain, db_url=db_url)
    b = simulate(secure, db_url=db_url)
    assert abs(a.final_accuracy - b.final_accuracy) <= 0.01, (a, b)
    rows = RunStore(db_url).rounds(b.run_id)
    assert all(r.secagg is not None and r.answered == 10 for r in rows)


def test_secagg_scenario_completes_every_round_with_dropouts_at_each_stage(db_url: str) -> None:
    scenario = load_scenario(SCENARIOS / "secagg.toml").with_overrides(rounds=2)
    summary = simulate(scenario, db_url=db_url)
    store = RunStore(db_url)
    rows = store.rounds(summary.run_id)
    assert summary.status == "finished" and [r.metrics["status"] for r in rows] == ["ok", "ok"]
    stages = {c.stage for c in store.client_results(summary.run_id) if c.outcome == "dropped"}
    assert {"advertise_keys", "share_keys", "masked_input"} <= stages
    for row in rows:
        completed = [s["completed"] for s in row.secagg["stages"]]
        assert completed == sorted(completed, reverse=True) and completed[0] == 9
        # the shipped scenario runs the actively secure protocol, and each round records it
        assert row.secagg["threat_model"] == "malicious"
        assert [s["stage"] for s in row.secagg["stages"]][3] == "consistency_check"
    assert store.get_run(summary.run_id).scenario["secagg"]["threat_model"] == "malicious"


def test_shipped_secagg_threshold_is_a_strict_majority() -> None:
    spec = load_scenario(SCENARIOS / "secagg.toml").secagg
    config = config_from_spec(spec)

    assert (spec.threat_model, config.threshold_for(10)) == ("malicious", 6)  # floor(10/2) + 1
    assert config_from_spec(type(spec)()).threshold_for(10) == 6  # the schema's default too


def test_a_half_threshold_needs_an_explicit_semi_honest_threat_model() -> None:
    with pytest.raises(ScenarioError, match=r"threshold.*0\.5.*semi-honest"):
        tiny_scenario(secagg={"enabled": True, "threshold": 0.5})
    relaxed = tiny_scenario(secagg={"enabled": True, "threshold": 0.5, "threat_model": "semi-honest"})
    assert relaxed.secagg.threat_model == "semi-honest"


def test_below_threshold_the_round_fails_cleanly_and_the_run_goes_on(db_url: str) -> None:
    scenario = tiny_scenario(rounds=2, federation={"clients": 6},
                             secagg={"enabled": True, "threshold": 5, "stage_timeout_s": 5.0},
                             faults={"dropouts": {"share_keys": 0.5}})
    summary = simulate(scenario, db_url=db_url)
    store = RunStore(db_url)
    rows = store.rounds(summary.run_id)
    assert summary.status == "failed" and len(rows) == 2  # no round changed the model (issue 12)
    assert store.get_run(summary.run_id).error.startswith("no round changed the model: all 2 rounds skipped")
    assert all(r.metrics["status"] == "skipped" and "aborted" in r.secagg for r in rows)
    reasons = {c.reason for c in store.client_results(summary.run_id)}
    assert any("share_keys" in (reason or "") for reason in reasons)


def test_without_client_metrics_the_store_holds_no_per_client_training_figures(db_url: str) -> None:
    # Prepare: the same tiny federation twice, with and without clear training metrics
    base = tiny_scenario(rounds=1, federation={"clients": 4}, evaluation={"federated": False},
                         secagg={"enabled": True, "max_weight": 1000.0})
    hidden = base.with_overrides(secagg={"enabled": True, "max_weight": 1000.0, "client_metrics": False})
    # Execute
    shown_run, hidden_run = simulate(base, db_url=db_url), simulate(hidden, db_url=db_url)
    # Assert: the same model either way (up to the stochastic rounding); only the run that asked
    # for none lacks per-client figures
    store = RunStore(db_url)
    shown, secret = store.client_results(shown_run.run_id), store.client_results(hidden_run.run_id)
    assert all(c.outcome == "ok" and c.num_examples > 0 and c.train_loss is not None for c in shown)
    assert all(c.outcome == "ok" and c.num_examples == 0 and c.train_loss is None and not c.metrics
               for c in secret)
    assert abs(shown_run.final_accuracy - hidden_run.final_accuracy) <= 0.01
