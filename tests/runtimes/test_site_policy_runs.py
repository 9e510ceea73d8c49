"""Devices whose site policy refuses, in an in-process federation: ``refused`` is a client status of its own,
named in the round line, the run's summary and its JSON, and the run does not end ``finished`` (issue 48, item 5).

The in-process runtime of ``quorum simulate`` (``InProcessGrid``, clients in this process), with the node configs
a deployment's devices would carry: some name a ``site-policy``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aggregator.serverapp import run_federation
from clients.clientapp import app
from core.outcomes import count, round_line
from core.records import RoundRecord
from runstore.store import RunStore
from runtimes.enrolment import secagg_identities
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.simulation import summarize
from scenarios.schema import Scenario
from tests.conftest import tiny_scenario

CLIENTS = 6
FED = {"clients": CLIENTS, "fraction": 1.0, "min_clients": 1}


def _federate(scenario: Scenario, policies: dict[int, Path], db_url: str) -> tuple[RunStore, str, list[str]]:
    """Run ``scenario`` on six nodes, node ``n`` with ``policies[n]``; the store, the run and its round lines."""
    identities = secagg_identities(scenario)
    nodes = [NodeSpec(n, {"partition-id": n - 1, "num-partitions": CLIENTS, **identities.get(n, {}),
                          **({"site-policy": str(policies[n])} if n in policies else {})})
             for n in range(1, CLIENTS + 1)]
    lines: list[str] = []

    def on_round(record: RoundRecord) -> None:  # what `quorum simulate` prints of each round
        lines.append(round_line(record.sampled, count(record.clients)))

    store = RunStore(db_url)
    with InProcessGrid(app, nodes, {"scenario-json": json.dumps(scenario.to_dict())}) as grid:
        run_id, _ = run_federation(grid, scenario, store, engine="inprocess", on_round=on_round)
    return store, run_id, lines


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_refusing_sites_are_named_in_each_round_line_the_summary_and_its_json(tmp_path: Path, db_url: str) -> None:
    # Prepare: sites 1 and 2 want secure aggregation, site 3 a cohort of 10; the run is plain, six a round
    secure = _write(tmp_path / "secure.toml", "require_secure_aggregation = true\n")
    cohort = _write(tmp_path / "cohort.toml", "min_cohort = 10\n")
    scenario = tiny_scenario(rounds=2, federation=FED)

    # Execute
    store, run_id, lines = _federate(scenario, {1: secure, 2: secure, 3: cohort}, db_url)
    summary = json.loads(json.dumps(summarize(store, run_id, 1.0).to_json()))  # what `--json` prints

    # Assert: each round, three refused with their rules, grouped; three trained
    expected = ("3/6 answered, 3 refused (policy: secure aggregation required [client 1, client 2]; "
                "cohort 6 under min_cohort 10 [client 3])")
    assert lines == [expected, expected]
    rows = {c.client: c for c in store.client_results(run_id, 2)}
    assert [rows[str(n)].outcome for n in range(1, 7)] == ["refused"] * 3 + ["ok"] * 3
    assert rows["3"].reason == "cohort 6 under min_cohort 10" and rows["1"].stage == "train"
    assert [(r.answered, r.failed, (r.metrics or {}).get("refused")) for r in store.rounds(run_id)] == [(3, 0, 3)] * 2
    # the run degraded, saying who refused and why; the JSON's counts are summed over the two rounds
    assert summary["status"] == "degraded"
    assert summary["error"] == ("3 of 6 sites refused: secure aggregation required (client 1, client 2); "
                                "cohort 6 under min_cohort 10 (client 3)")
    assert summary["clients"] == {"answered": 6, "dropped": 0, "rejected": 0, "failed": 0, "refused": 6}
    # and each refusal is in the audit trail, as the device's, with its round and rule
    from runstore.audit import POLICY_REFUSAL, verify
    from runstore.audit import rows as audit_rows

    trail = sorted((r.detail["round"], r.actor, r.detail["reason"]) for r in audit_rows(store, limit=100)
                   if r.action == POLICY_REFUSAL and r.target == run_id)
    assert trail == sorted((n, f"device:{c}", why) for n in (1, 2) for c, why in
                           (("1", "secure aggregation required"), ("2", "secure aggregation required"),
                            ("3", "cohort 6 under min_cohort 10")))
    assert verify(store).ok


def test_the_same_sites_accept_a_run_under_secure_aggregation(tmp_path: Path, db_url: str) -> None:
    # Prepare
    secure = _write(tmp_path / "secure.toml", "require_secure_aggregation = true\nmin_cohort = 6\n")
    scenario = tiny_scenario(rounds=2, federation=FED, secagg={"enabled": True})

    # Execute
    store, run_id, lines = _federate(scenario, {1: secure, 2: secure}, db_url)

    # Assert
    assert lines == ["6/6 answered"] * 2
    assert store.get_run(run_id).status == "finished"
    assert summarize(store, run_id, 1.0).clients == {"answered": 12, "dropped": 0, "rejected": 0, "failed": 0,
                                                       "refused": 0}


def test_a_run_every_site_refuses_fails_and_says_why(tmp_path: Path, db_url: str) -> None:
    # Prepare: every site wants a DP budget of at most 1; the run has no DP
    strict = _write(tmp_path / "strict.toml", "max_epsilon = 1.0\n")
    scenario = tiny_scenario(rounds=1, federation=FED)

    # Execute
    store, run_id, lines = _federate(scenario, dict.fromkeys(range(1, CLIENTS + 1), strict), db_url)

    # Assert: nothing learned, so failed, not degraded; the refusals are the reason
    run: Any = store.get_run(run_id)
    names = ", ".join(f"client {n}" for n in range(1, 4)) + ", ..."
    assert lines == [f"0/6 answered, 6 refused (policy: no client-level DP (max_epsilon = 1) [{names}])"]
    assert run.status == "failed"
    assert run.error == ("no round changed the model: all 1 rounds skipped or rejected (round 1 skipped); 6 of 6 "
                         "sites refused: no client-level DP (max_epsilon = 1) (client 1, client 2, client 3, ...)")
