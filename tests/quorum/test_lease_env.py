"""``QUORUM_LEASE_S`` out of its range stops ``quorum simulate`` before its run: exit 2, one line naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from runstore.lease import LEASE_ENV
from runstore.store import RunStore
from tests.quorum.test_cli import TINY, assert_clean_exit_2, cli


@pytest.mark.parametrize("raw", ["1e308", "nan", "-1", "abc", "0"])
def test_simulate_refuses_a_bad_lease_before_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     raw: str) -> None:
    # Prepare: a lease of 1e308 s is a number, but its renewing thread could never wait 1e308 / 6 s
    scenario = tmp_path / "cli-tiny.toml"
    scenario.write_text(TINY)
    db = f"sqlite:///{tmp_path / 'r.db'}"
    monkeypatch.setenv(LEASE_ENV, raw)

    # Execute
    out = cli("simulate", str(scenario), "--db", db, "--workers", "1", check=False)

    # Assert: exit 2 by the command's own error path, one line naming the variable, its value and range; no run
    assert_clean_exit_2(out)
    assert out.stderr.strip() == (f"error: {LEASE_ENV}={raw!r}: the run lease must be a number of seconds in "
                                  "[0.1, 604,800] (default 30)")  # that line alone: no display opened
    assert RunStore(db).list_runs() == []
