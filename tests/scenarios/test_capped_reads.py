"""User files are read with a cap before parsing (issue 32): ``quorum simulate /dev/zero`` must not eat the memory.

A scenario file is read up to :data:`~scenarios.schema.MAX_SCENARIO_BYTES`, a
CSV data file up to :data:`~learning.datasets.MAX_CSV_BYTES`, counted while
reading; beyond, one line names the file and the cap.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from learning.datasets import MAX_CSV_BYTES, load_file
from learning.errors import DataError
from quorum.cli import app
from scenarios.errors import ScenarioError
from scenarios.schema import MAX_SCENARIO_BYTES, load_scenario

needs_dev_zero = pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")


def sparse(path: Path, size: int, head: bytes = b"") -> Path:
    """A file of ``size`` bytes that costs no disk: ``head``, then a hole of zeros."""
    with path.open("wb") as handle:
        handle.write(head)
        handle.truncate(size)
    return path


@needs_dev_zero
def test_a_scenario_read_from_dev_zero_is_refused_naming_the_file_and_the_cap() -> None:
    with pytest.raises(ScenarioError, match=r"^/dev/zero: larger than 1 MiB, the most a scenario file may hold$"):
        load_scenario("/dev/zero")


def test_a_large_sparse_scenario_file_is_refused(tmp_path: Path) -> None:
    path = sparse(tmp_path / "huge.toml", 4 * 2**30, b'name = "huge"\n')
    with pytest.raises(ScenarioError, match="huge.toml: larger than 1 MiB"):
        load_scenario(path)


def test_a_scenario_at_the_cap_is_parsed(tmp_path: Path) -> None:
    # Prepare: a valid scenario padded with a comment to exactly the cap
    head = b'name = "at-cap"\nrounds = 1\n# '
    path = tmp_path / "at-cap.toml"
    path.write_bytes(head + b"x" * (MAX_SCENARIO_BYTES - len(head) - 1) + b"\n")
    # Execute / Assert
    assert load_scenario(path).name == "at-cap"


def test_crlf_scenario_files_still_parse(tmp_path: Path) -> None:
    path = tmp_path / "crlf.toml"
    path.write_bytes(b'name = "crlf"\r\nrounds = 2\r\n')
    assert load_scenario(path).rounds == 2


@needs_dev_zero
def test_quorum_simulate_dev_zero_exits_2_with_one_line() -> None:
    result = CliRunner().invoke(app, ["simulate", "/dev/zero"])
    assert result.exit_code == 2, (result.stdout, result.stderr, result.exception)
    assert result.stderr.strip() == "error: /dev/zero: larger than 1 MiB, the most a scenario file may hold"


@needs_dev_zero
def test_a_csv_data_file_that_never_ends_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "zero.csv"
    link.symlink_to("/dev/zero")
    with pytest.raises(DataError, match=r"zero.csv: larger than 256 MiB, the most a CSV data file may hold"):
        load_file(link)


def test_a_large_sparse_csv_data_file_is_refused(tmp_path: Path) -> None:
    path = sparse(tmp_path / "big.csv", MAX_CSV_BYTES + 1, b"x,label\n1,0\n")
    with pytest.raises(DataError, match=r"big.csv: larger than 256 MiB"):
        load_file(path)


def test_a_small_csv_data_file_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "ok.csv"
    path.write_text("x,label\n1.5,0\n2.5,1\n", encoding="utf-8")
    data = load_file(path)
    assert len(data) == 2
