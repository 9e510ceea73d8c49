"""The agent's ``--policy`` and ``quorum client policy check`` (issue 48, item 5), without starting anything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deploy.agent import AgentSpec, child_args, main, supernode_argv
from deploy.agent_cli import app
from runstore.store import RunStore
from tests.conftest import tiny_scenario

PLAIN = """name = "plain"
rounds = 3
[data]
dataset = "digits"
[model]
name = "logreg"
[federation]
clients = 6
fraction = 0.5
"""
SECURE = PLAIN.replace('"plain"', '"secure"') + "[secagg]\nenabled = true\n"


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


def test_the_policy_reaches_the_worker_in_the_nodes_own_config_with_its_round_count(tmp_path: Path) -> None:
    spec = AgentSpec(server="h:1", data=tmp_path / "d.csv", key=None, ca=None, insecure=True,
                     workdir=tmp_path / "agent", policy=tmp_path / "policy.toml")

    node_config = supernode_argv(spec)[supernode_argv(spec).index("--node-config") + 1]
    worker = child_args(spec)["worker"]

    assert f'site-policy="{(tmp_path / "policy.toml").resolve()}"' in node_config
    assert f'site-policy-rounds="{(tmp_path / "agent" / "policy-rounds.json").resolve()}"' in node_config
    assert worker[worker.index("--policy") + 1] == str((tmp_path / "policy.toml").resolve())
    assert "site-policy" not in supernode_argv(AgentSpec(server="h:1", data=tmp_path / "d", key=None, ca=None,
                                                          insecure=True))[-1]


def test_the_worker_says_at_start_which_rules_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("deploy.agent.serve_tasks", lambda *_: None)
    monkeypatch.setattr("signal.signal", lambda *_: None)  # main's SIGTERM handler: not in pytest's process
    policy = tmp_path / "policy.toml"
    policy.write_text("require_secure_aggregation = true\nmin_cohort = 5\n")

    main(["worker", "--runtime", "127.0.0.1:9094", "--policy", str(policy)])

    assert f"quorum-worker: site policy {policy}: require_secure_aggregation, min_cohort = 5" in capsys.readouterr().out


def test_a_bad_policy_stops_the_agent_before_it_joins_in_one_line(tmp_path: Path) -> None:
    data, policy = tmp_path / "d.csv", tmp_path / "policy.toml"
    data.write_text("x,label\n1,0\n")
    policy.write_text("max_epsilon = -8\n")

    result = _cli("start", "--server", "h:1", "--data", str(data), "--insecure", "--policy", str(policy))

    assert result.exit_code == 2
    assert f"error: {policy}: max_epsilon = -8: must be a number in (0, 1000]" in result.output
    missing = _cli("start", "--server", "h:1", "--data", str(data), "--insecure", "--policy", str(tmp_path / "no"))
    assert missing.exit_code == 2 and f"--policy {tmp_path / 'no'}: no such file" in missing.output


def test_the_agent_takes_policy_toml_from_its_folder_by_default(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: start the agent up to the point where it would run (nothing is started)
    started: list[AgentSpec] = []
    monkeypatch.setattr("deploy.agent.run_agent", lambda spec, **_: started.append(spec) or 0)
    monkeypatch.setattr("deploy.agent_cli._preflight", lambda *_: (9094, None))
    data, workdir = tmp_path / "d.csv", tmp_path / "agent"
    data.write_text("x,label\n1,0\n")
    workdir.mkdir()

    # Execute: without a policy.toml, then with one
    without = _cli("start", "--server", "h:1", "--data", str(data), "--insecure", "--workdir", str(workdir))
    (workdir / "policy.toml").write_text("min_cohort = 3\n")
    with_file = _cli("start", "--server", "h:1", "--data", str(data), "--insecure", "--workdir", str(workdir))

    # Assert
    assert [s.policy for s in started] == [None, workdir / "policy.toml"]
    assert "site policy: none (every round the aggregator asks for is accepted)" in without.output
    assert f"site policy: {workdir / 'policy.toml'}: min_cohort = 3" in with_file.output


def test_policy_check_says_which_scenarios_it_would_accept_and_why_not(tmp_path: Path) -> None:
    # Prepare: a device wanting secure aggregation and at least 3 clients a round; both scenarios sample 3 of 6
    policy = tmp_path / "policy.toml"
    policy.write_text("require_secure_aggregation = true\nmin_cohort = 3\n")
    plain, secure = tmp_path / "plain.toml", tmp_path / "secure.toml"
    plain.write_text(PLAIN)
    secure.write_text(SECURE)

    # Execute
    result = _cli("policy", "check", str(plain), str(secure), "--policy", str(policy))
    as_json = _cli("policy", "check", str(secure), "--policy", str(policy), "--json")

    # Assert: refused is exit 1; all accepted exit 0
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == f"site policy {policy}: require_secure_aggregation, min_cohort = 3"
    assert lines[1].startswith(f"{plain} (plain): refused: secure aggregation required (task sha256 ")
    assert lines[2].startswith(f"{secure} (secure): accepted (task sha256 ")
    verdict = json.loads(as_json.output)["verdicts"][0]
    assert as_json.exit_code == 0 and verdict["accepted"] and len(verdict["task_sha256"]) == 64


def test_policy_check_judges_the_running_runs_of_a_store(tmp_path: Path, db_url: str) -> None:
    # Prepare: one running run with DP (epsilon 2.5 as its target), one finished without
    store = RunStore(db_url)
    dp = tiny_scenario(dp={"enabled": True, "target_epsilon": 2.5}).to_dict()
    running = store.create_run(name="dp-run", scenario=dp, seed=1, strategy="fedavg", rounds=2)
    done = store.create_run(name="old", scenario=tiny_scenario().to_dict(), seed=1, strategy="fedavg", rounds=2)
    store.set_status(done, "finished")
    policy = tmp_path / "policy.toml"
    policy.write_text("max_epsilon = 2\n")

    # Execute
    current = json.loads(_cli("policy", "check", "--db", db_url, "--policy", str(policy), "--json").output)
    every = _cli("policy", "check", "--db", db_url, "--policy", str(policy), "--all")

    # Assert
    assert [(v["target"], v["reasons"]) for v in current["verdicts"]] == [
        (f"run {running} (dp-run, running)", ["DP budget epsilon 2.5 over max_epsilon 2"])]
    assert f"run {done} (old, finished): refused: no client-level DP (max_epsilon = 2)" in every.output
