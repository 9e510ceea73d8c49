"""``quorum aggregator run``: submit a federated run to this host's SuperLink."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aggregator.errors import ResumeRefused
from aggregator.resume import check_same_scenario, has_ended
from deploy.config import DeployConfig
from deploy.enroll import device_names, device_orgs
from deploy.errors import DeployError
from deploy.flower import submit_run
from runstore.store import Run, RunStore
from scenarios.schema import Scenario, load_scenario, scenario_from_dict

__all__ = ["submit", "run_config", "submitted_scenario"]


def submitted_scenario(config: DeployConfig, scenario: Path | None = None, resume: str | None = None) -> Scenario:
    """Return the scenario a submission runs: the file's, or the stored run's when resuming.

    Raises
    ------
    DeployError
        Neither a scenario file nor ``resume`` was given.
    """
    if resume:
        with RunStore(config.db_url) as store:
            stored = store.get_run(resume)
        return scenario_from_dict(stored.scenario, source=f"run {stored.id}")
    if scenario is None:
        raise DeployError("name a scenario file, or --resume RUN_ID")
    return load_scenario(scenario)


def run_config(config: DeployConfig, scenario: Path | None = None, resume: str | None = None,
               overrides: Mapping[str, Any] | None = None, spec: Mapping[str, Any] | None = None,
               submitter: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Build the ServerApp's run_config: the scenario inline, the store, and who is who.

    The scenario goes inline because the ServerApp may run elsewhere than the
    file. A resumed run continues with its own scenario only. ``spec`` is a
    scenario as plain data (a remote submission's) instead of a file;
    ``submitter`` its ``account``, ``org`` and ``submission`` id, recorded with the run.
    """
    if resume:
        with RunStore(config.db_url) as store:
            stored = store.get_run(resume)
        _check_resumable(stored, scenario, overrides)
        spec, resume = stored.scenario, stored.id
    elif spec is not None:
        spec = scenario_from_dict(spec, source="submission").to_dict()
    elif scenario is not None:
        spec = load_scenario(scenario).to_dict()
    else:
        raise DeployError("name a scenario file, or --resume RUN_ID")
    extra = _submitter(submitter)
    return {"scenario-json": json.dumps(spec), "db": config.db_url, "resume": resume or "",
            "overrides": json.dumps(dict(overrides or {})),
            "wait-clients-s": float(config.aggregator.wait_clients_s),
            "devices": json.dumps({str(k): v for k, v in device_names(config).items()}),
            "orgs": json.dumps(device_orgs(config)),
            "state-dir": str(config.state.root), "federation": config.aggregator.name, **extra}


def _submitter(submitter: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return the run_config keys naming who submitted a run remotely (none for ``quorum aggregator run``)."""
    if not submitter:
        return {}
    return {"submitted-by": str(submitter["account"]), "submitted-org": str(submitter.get("org", "")),
            "submission": int(submitter["submission"])}


def _check_resumable(run: Run, scenario: Path | None, overrides: Mapping[str, Any] | None) -> None:
    """Refuse, before a submission, to resume a run that ended or with another scenario (a file, or overrides)."""
    asked = scenario_from_dict(run.scenario, source=f"run {run.id}") if scenario is None else load_scenario(scenario)
    check_same_scenario(run, asked.with_overrides(**overrides) if overrides else asked)
    if has_ended(run):
        raise ResumeRefused(f"run {run.id} already ended ({run.status}, {run.rounds_done}/{run.rounds_total} rounds): "
                            "nothing to resume, the run is left as it was")


def submit(config: DeployConfig, scenario: Path | None = None, resume: str | None = None,
           overrides: Mapping[str, Any] | None = None, spec: Mapping[str, Any] | None = None,
           submitter: Mapping[str, Any] | None = None) -> int:
    """Submit; returns the Flower run id (the stored run id appears once the ServerApp opens it)."""
    return submit_run(config, run_config(config, scenario, resume, overrides, spec, submitter))
