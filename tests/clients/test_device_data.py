"""A deployed device reads its data file once, and again when the file changes (issue 17, item 4)."""

from __future__ import annotations

from pathlib import Path

from clients.clientapp import _node_data
from tests.conftest import tiny_scenario


class CountingTask:
    """Stands in for a task: each read returns the file's text and how many reads there were."""

    def __init__(self) -> None:
        self.reads = 0

    def device_data(self, path: str) -> tuple[int, str]:
        self.reads += 1
        return self.reads, Path(path).read_text()


def test_an_edited_data_file_is_read_again_and_an_unchanged_one_is_not(tmp_path: Path) -> None:
    task, scenario = CountingTask(), tiny_scenario()
    data = tmp_path / "local.csv"
    data.write_text("label,a\n1,0.5\n")
    node = {"data-path": str(data)}

    first = _node_data(task, scenario, node)  # type: ignore[arg-type]
    again = _node_data(task, scenario, node)  # type: ignore[arg-type]
    data.write_text("label,a\n1,0.5\n0,0.25\n")
    edited = _node_data(task, scenario, node)  # type: ignore[arg-type]

    assert first == again == (1, "label,a\n1,0.5\n")
    assert edited == (2, "label,a\n1,0.5\n0,0.25\n")
