"""A data-parallel worker's environment (torchrun's ranks, ``QUORUM_LEASE_S``): refused before it starts, by name."""

from __future__ import annotations

import pytest

from runtimes.parallel import worker
from runtimes.parallel.errors import ParallelError

TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*TORCHRUN, "QUORUM_LEASE_S"):
        monkeypatch.delenv(name, raising=False)


def test_without_torchrun_a_worker_is_rank_0_of_1() -> None:
    assert worker._ranks() == (0, 1, 1)


def test_torchrun_ranks_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the third of 4 workers, 2 on this machine
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    # Execute / Assert
    assert worker._ranks() == (2, 4, 2)


@pytest.mark.parametrize(("env", "message"), [
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK='2': this worker's rank must be a whole number in [0, 1] (default 0)"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0': the number of workers must be a whole number in [1, 1,000,000] "
                          "(default 1)"),
    ({"WORLD_SIZE": "1e308"}, "WORLD_SIZE='1e308': the number of workers must be a whole number in "
                              "[1, 1,000,000] (default 1)"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0': the workers on this machine must be a "
                                                   "whole number in [1, 2] (default 2)"),
])
def test_a_bad_torchrun_variable_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                       message: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ParallelError) as info:
        worker._ranks()
    assert str(info.value) == message


@pytest.mark.parametrize("raw", ["1e308", "nan", "-1", "abc", "0"])
def test_a_bad_lease_stops_the_worker_before_it_joins_the_job(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str], raw: str) -> None:
    # Prepare
    monkeypatch.setenv("QUORUM_LEASE_S", raw)

    # Execute: main without torchrun's @record, which installs a fault handler on the real stderr
    code = worker.main.__wrapped__(["--scenario", "scenarios/quickstart.toml"])

    # Assert: exit 1 with one line naming the variable, before any process group or round
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err
    assert err.startswith(f"[quorum parallel] worker cannot start: QUORUM_LEASE_S={raw!r}: the run lease must be")
