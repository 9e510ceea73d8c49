"""Fixtures for the runtime tests; the process helpers live in ``processes.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtimes.processes import Processes, describe


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(workdir=tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()
        left = procs.alive()
        assert not left, f"processes outlived the test:\n{describe(left)}"
