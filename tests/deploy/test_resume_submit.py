"""``quorum aggregator run --resume RUN`` continues a run with its own scenario only (issue 32, item 3).

Other settings (a scenario file, ``--rounds``) used to be submitted and trained
on the old run; a finished run was run again. Both are refused before
anything is submitted, and the run is left as it was.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aggregator.errors import ResumeRefused
from deploy.config import load_config
from deploy.submit import run_config
from runstore.store import RunStore
from tests.conftest import tiny_scenario


def config(tmp_path: Path) -> Any:
    path = tmp_path / "federation.toml"
    path.write_text('[aggregator]\nlisten = "127.0.0.1"\n')
    return load_config(path)


def stored_run(cfg: Any, status: str | None = None) -> str:
    store = RunStore(cfg.db_url)
    run_id = store.create_run(name="tiny", scenario=tiny_scenario().to_dict(), seed=3, strategy="fedavg", rounds=2,
                              engine="deployment")
    if status is not None:
        store.set_status(run_id, status)
    return run_id


def test_the_run_s_own_scenario_is_submitted(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    run_id = stored_run(cfg, "interrupted")
    submitted = run_config(cfg, resume=run_id[:10])
    assert submitted["resume"] == run_id and json.loads(submitted["scenario-json"]) == tiny_scenario().to_dict()
    assert submitted["federation"] == cfg.aggregator.name  # which federation's standby may resume it
    assert json.loads(str(submitted["orgs"])) == {}  # no device enrolled with an organisation here


def test_other_settings_are_refused_before_submitting(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    run_id = stored_run(cfg, "interrupted")
    other = tmp_path / "other.toml"
    other.write_text('name = "tiny"\nseed = 3\nrounds = 2\n[data]\ndataset = "digits"\npartition = "iid"\n'
                     'server_test_fraction = 0.2\n[model]\nname = "mlp"\n[federation]\nclients = 4\n'
                     'fraction = 1.0\nmin_clients = 1\ndeadline_s = 20.0\n[training]\nlocal_epochs = 1\n'
                     'batch_size = 16\nlr = 0.1\n')

    with pytest.raises(ResumeRefused, match=r"has another scenario: rounds: 2 in the run, 5 in the scenario;"):
        run_config(cfg, resume=run_id, overrides={"rounds": 5})
    with pytest.raises(ResumeRefused, match=r'scenario: model\.name: "logreg" in the run, "mlp" in the scenario;'):
        run_config(cfg, other, resume=run_id)
    assert RunStore(cfg.db_url).get_run(run_id).status == "interrupted"


def test_a_finished_run_is_not_submitted_again(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    run_id = stored_run(cfg, "finished")
    with pytest.raises(ResumeRefused, match=rf"^run {run_id} already ended \(finished, 0/2 rounds\): nothing"):
        run_config(cfg, resume=run_id)
