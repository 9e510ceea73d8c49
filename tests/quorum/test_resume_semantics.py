"""What ``quorum resume`` continues, and what it refuses (issue 32, item 3).

A run continues only with its own scenario: another is refused with one line
naming what differs (exit 2), and the run is left as it was; that used to
train the new settings on the old run, or (another model) raise a raw
ValueError and mark the finished run ``failed``. A finished run is left
untouched (its ``finished_at`` used to be rewritten). ``--from RUN --round N``
starts a new run from that round's checkpoint and records its parent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from aggregator.errors import ResumeRefused
from quorum.cli import app
from runstore.store import RunStore
from runtimes.simulation import simulate
from tests.conftest import tiny_scenario

TOML = """name = "tiny"
seed = {seed}
rounds = {rounds}
[data]
dataset = "digits"
partition = "iid"
server_test_fraction = 0.2
[model]
name = "{model}"
[federation]
clients = 4
fraction = 1.0
min_clients = 1
deadline_s = 20.0
[training]
local_epochs = 1
batch_size = 16
lr = 0.1
"""


@dataclass(frozen=True)
class Finished:
    """A store holding one finished run of ``tiny_scenario()`` (2 rounds)."""

    db: str
    run_id: str
    folder: Path

    def scenario_file(self, name: str, seed: int = 3, rounds: int = 2, model: str = "logreg") -> Path:
        path = self.folder / f"{name}.toml"
        path.write_text(TOML.format(seed=seed, rounds=rounds, model=model))
        return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    folder = tmp_path_factory.mktemp("resume")
    db = f"sqlite:///{folder / 'runs.db'}"
    summary = simulate(tiny_scenario(), db_url=db, workers=1)
    assert summary.status == "finished"
    return Finished(db, summary.run_id, folder)


def snapshot(store: RunStore, run_id: str) -> tuple:
    """Everything resuming could change about a run."""
    run = store.get_run(run_id)
    return (run.status, run.finished_at, run.updated_at, run.rounds_done, run.rounds_total, run.seed, run.error,
            [r.round for r in store.rounds(run_id)], len(store.events(run_id)))


def resume(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["resume", *args])
    return result.exit_code, result.stderr


@pytest.mark.parametrize(("name", "settings", "named"), [
    ("more-rounds", {"rounds": 3}, "rounds: 2 in the run, 3 in the scenario"),
    ("other-model", {"model": "mlp"}, 'model.name: "logreg" in the run, "mlp" in the scenario'),
    ("other-seed", {"seed": 4}, "seed: 3 in the run, 4 in the scenario"),
])
def test_another_scenario_is_refused_in_one_line_and_the_run_is_left_as_it_was(
        finished: Finished, name: str, settings: dict, named: str) -> None:
    # Prepare
    store = RunStore(finished.db)
    before = snapshot(store, finished.run_id)
    # Execute
    code, err = resume(finished.run_id, str(finished.scenario_file(name, **settings)), "--db", finished.db,
                       "--workers", "1")
    # Assert
    assert code == 2, err
    assert err.count("\n") == 1 and f"run {finished.run_id} has another scenario: {named};" in err
    assert f"quorum resume --from {finished.run_id} --round N SCENARIO" in err
    assert snapshot(store, finished.run_id) == before


@pytest.mark.parametrize(("overrides", "named"), [
    ({"rounds": 3}, "rounds: 2 in the run, 3 in the scenario"),
    ({"model": {"name": "mlp"}}, 'model.name: "logreg" in the run, "mlp" in the scenario'),
])
def test_the_serverapp_resume_path_refuses_another_scenario_too(finished: Finished, overrides: dict,
                                                                named: str) -> None:
    # Prepare: what a ServerApp gets with run_config resume=RUN and other settings
    store = RunStore(finished.db)
    before = snapshot(store, finished.run_id)
    # Execute / Assert
    with pytest.raises(ResumeRefused, match=f"has another scenario: {named};"):
        simulate(tiny_scenario(**overrides), db_url=finished.db, resume_id=finished.run_id, workers=1)
    assert snapshot(store, finished.run_id) == before


def test_resuming_a_finished_run_leaves_it_untouched_and_says_so(finished: Finished) -> None:
    store = RunStore(finished.db)
    before = snapshot(store, finished.run_id)

    code, err = resume(finished.run_id[:-1], str(finished.scenario_file("same")), "--db", finished.db)

    assert code == 0, err
    assert f"run {finished.run_id} already ended (finished, 2/2 rounds, at " in err
    assert "nothing to resume, the run is left as it was" in err
    assert snapshot(store, finished.run_id) == before
    assert not any("resumed" in e.message for e in store.events(finished.run_id))


def test_from_a_round_starts_a_new_run_that_records_its_parent(finished: Finished) -> None:
    # Prepare
    store = RunStore(finished.db)
    before = snapshot(store, finished.run_id)
    # Execute: a new run from round 1, with the run's own scenario
    code, err = resume("--from", finished.run_id, "--round", "1", "--db", finished.db, "--workers", "1")
    # Assert: a new id, its parent recorded, round 2 trained again exactly as the parent trained it
    assert code == 0, err
    child = next(r for r in store.list_runs() if (r.info or {}).get("parent"))
    assert child.id != finished.run_id and f"new run {child.id} from round 1 of run {finished.run_id}" in err
    assert child.info["parent"] == {"run": finished.run_id, "round": 1}
    assert (child.status, child.rounds_done, [r.round for r in store.rounds(child.id)]) == ("finished", 2, [2])
    np.testing.assert_array_equal(store.load_state(child.id).params, store.load_state(finished.run_id).params)
    assert snapshot(store, finished.run_id) == before


def test_from_a_round_with_another_scenario_trains_its_settings(finished: Finished) -> None:
    store = RunStore(finished.db)
    path = finished.scenario_file("longer", rounds=3)

    code, err = resume("--from", finished.run_id, "--round", "2", str(path), "--db", finished.db, "--workers", "1")

    assert code == 0, err
    child = next(r for r in store.list_runs() if (r.info or {}).get("parent") == {"run": finished.run_id, "round": 2})
    assert (child.rounds_total, [r.round for r in store.rounds(child.id)]) == (3, [3])


@pytest.mark.parametrize(("args", "message"), [
    (["--round", "5"], "has no round 5 to start from (it holds rounds 1 to 2)"),
    (["--round", "2"], "tiny: rounds = 2 leaves none to run after round 2; set rounds above 2"),
    (["--round", "1", "MLP"], "the scenario's model does not fit round 1 of run"),
])
def test_from_a_round_refuses_what_cannot_start(finished: Finished, args: list[str], message: str) -> None:
    store = RunStore(finished.db)
    runs = len(store.list_runs())
    args = [str(finished.scenario_file("mlp", model="mlp")) if a == "MLP" else a for a in args]

    code, err = resume("--from", finished.run_id, *args, "--db", finished.db)

    assert code == 2 and message in err, err
    assert len(store.list_runs()) == runs  # no run was created


def test_a_run_whose_process_still_renews_its_lease_is_not_resumed(db_url: str) -> None:
    # Prepare: a run that is running, its lease fresh
    store = RunStore(db_url)
    run_id = store.create_run(name="tiny", scenario=tiny_scenario().to_dict(), seed=3, strategy="fedavg", rounds=2)
    before, lease = snapshot(store, run_id), store.get_run(run_id).lease_until
    # Execute
    code, err = resume(run_id, "--db", db_url)
    # Assert: refused naming who drives it and until when; the run's holder and lease untouched
    line = " ".join(err.split())
    assert code == 2 and f"run {run_id} is being driven by another process (lease until " in line, err
    assert line.endswith("; resume it when that process stopped")
    assert snapshot(store, run_id) == before
    assert (store.get_run(run_id).holder, store.get_run(run_id).lease_until) == (None, lease)


def test_round_without_from_is_refused(finished: Finished) -> None:
    code, err = resume(finished.run_id, "--round", "1", "--db", finished.db)
    assert code == 2 and "quorum resume --from RUN --round N" in err
