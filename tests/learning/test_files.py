"""Users' own data files: CSV and NPZ, and a one-line DataError for each kind of damage."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from learning.datasets import load_client_data, load_file
from learning.errors import DataError


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_csv_label_column_anywhere(tmp_path: Path) -> None:
    path = _write(tmp_path, "d.csv", "a,label,b\n1.5,0,2\n3,2,-4e1\n\n5,1,6\n")
    data = load_file(path)
    np.testing.assert_array_equal(data.x, np.array([[1.5, 2], [3, -40], [5, 6]], np.float32))
    np.testing.assert_array_equal(data.y, np.array([0, 2, 1]))
    assert data.x.dtype == np.float32 and data.y.dtype == np.int64


def test_csv_named_label_column_and_bom(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_bytes("\ufeffdigit,f1\n3,0.25\n".encode("utf-8"))
    data = load_file(path, label_column="digit")
    assert data.y.tolist() == [3] and data.x.tolist() == [[0.25]]


def test_npz_keeps_the_example_shape(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.arange(24, dtype=np.float64).reshape(4, 1, 2, 3), y=np.array([0, 1, 1, 0]))
    data = load_file(path)
    assert data.x.shape == (4, 1, 2, 3) and data.x.dtype == np.float32
    assert data.y.tolist() == [0, 1, 1, 0]


CSV_CASES = [
    ("missing column", "a,b\n1,2\n", "no label column 'label'; columns are a, b"),
    ("non-numeric", "a,label\n1,0\nx7,1\n", "line 3, column 'a': 'x7' is not a number; write a number there, or "
     "remove the row"),
    ("empty cell", "a,label\n,0\n", "line 2, column 'a': '' is not a number; write a number there, or remove the row"),
    ("ragged row", "a,b,label\n1,2,0\n1,0\n",
     "line 3 has 2 values, the header has 3: column 'label' is empty there; fill them in, or remove the row"),
    ("extra value", "a,label\n1,0\n1,0,7\n", "line 3 has 3 values, the header has 2: 1 value(s) after the last "
     "column 'label' ('7') have no column; give that column a name in the header, or remove the values"),
    ("nan", "a,label\n1,0\nnan,1\n", "line 3, column 'a': value is NaN or infinite; write a finite number there, "
     "or remove the row"),
    ("infinite", "a,label\ninf,0\n", "line 2, column 'a': value is NaN or infinite; write a finite number "
     "there, or remove the row"),
    ("empty", "", "file is empty"),
    ("header only", "a,label\n", "no data rows after the header"),
    ("label only", "label\n1\n", "no feature columns besides 'label'"),
    ("fractional label", "a,label\n1,0.5\n", "line 2, column 'label': label 0.5 is not a non-negative integer; "
     "number the classes 0, 1, 2, ..."),
    ("negative label", "a,label\n1,-1\n", "line 2, column 'label': label -1 is not a non-negative integer; "
     "number the classes 0, 1, 2, ..."),
]


@pytest.mark.parametrize(("case", "text", "message"), CSV_CASES, ids=[c[0] for c in CSV_CASES])
def test_malformed_csv(tmp_path: Path, case: str, text: str, message: str) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(DataError) as info:
        load_file(path)
    assert str(info.value) == f"{path}: {message}"
    assert "\n" not in str(info.value)


def _npz(tmp_path: Path, **arrays: np.ndarray) -> Path:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return path


NPZ_CASES = [
    ("missing y", {"x": np.zeros((2, 2))}, "missing array 'y'; found ['x']: an NPZ data file needs arrays 'x' and "
     "'y' (features and labels: np.savez(path, x=features, y=labels))"),
    ("lengths differ", {"x": np.zeros((3, 2)), "y": np.zeros(2)},
     "x has shape (3, 2) but y has shape (2,); need one label per example"),
    ("nan", {"x": np.array([[1.0, 2.0], [3.0, np.nan]]), "y": np.zeros(2)},
     "example 1, feature 1: value is NaN or infinite; write a finite number there, or remove the example"),
    ("empty", {"x": np.zeros((0, 2)), "y": np.zeros(0)}, "file is empty (no examples)"),
    ("text x", {"x": np.array([["a"]]), "y": np.zeros(1)}, "array 'x' is not numeric (dtype <U1); save numbers "
     "only: np.savez(path, x=features, y=labels) with arrays of numbers"),
]


@pytest.mark.parametrize(("case", "arrays", "message"), NPZ_CASES, ids=[c[0] for c in NPZ_CASES])
def test_malformed_npz(tmp_path: Path, case: str, arrays: dict, message: str) -> None:
    path = _npz(tmp_path, **arrays)
    with pytest.raises(DataError) as info:
        load_file(path)
    assert str(info.value) == f"{path}: {message}"


def test_npz_object_arrays_are_never_unpickled(tmp_path: Path) -> None:
    path = _npz(tmp_path, x=np.array([{"a": 1}], dtype=object), y=np.zeros(1))
    with pytest.raises(DataError, match=r"bad\.npz: array 'x' is not numeric \(dtype object\)"):
        load_file(path)


def test_corrupt_npz(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.npz", "this is not a zip archive")
    with pytest.raises(DataError, match=r"bad\.npz: not a valid \.npz archive"):
        load_file(path)


def test_missing_file_and_unknown_type(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nope.csv: cannot read file"):
        load_file(tmp_path / "nope.csv")
    with pytest.raises(DataError, match=r"d\.json: unsupported file type '\.json'; expected \.csv or \.npz"):
        load_file(_write(tmp_path, "d.json", "{}"))


def test_load_client_data_splits_by_fraction(tmp_path: Path) -> None:
    # 50 rows, test_fraction 0.2 -> 10 test and 40 train examples; feature a = row number
    rows = "".join(f"{i},{i % 3}\n" for i in range(50))
    path = _write(tmp_path, "mine.csv", "a,label\n" + rows)
    data = load_client_data(path, test_fraction=0.2, seed=3)
    assert (len(data.train), len(data.test)) == (40, 10)
    seen = np.concatenate([data.train.x[:, 0], data.test.x[:, 0]])
    np.testing.assert_array_equal(np.sort(seen), np.arange(50))
    np.testing.assert_array_equal(data.train.y, data.train.x[:, 0].astype(int) % 3)
    again = load_client_data(path, test_fraction=0.2, seed=3)
    np.testing.assert_array_equal(again.test.x, data.test.x)


def test_load_client_data_rejects_a_bad_fraction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="test_fraction must be in"):
        load_client_data(tmp_path / "x.csv", test_fraction=1.0)


def test_an_npz_that_expands_past_the_cap_is_refused_before_decompressing(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 4 MiB of zeros compressed to a few KiB (a small zip bomb), under a 1 MiB cap
    import learning.datafiles as datafiles

    monkeypatch.setattr(datafiles, "MAX_NPZ_BYTES", 2**20)
    path = tmp_path / "bomb.npz"
    np.savez_compressed(path, x=np.zeros((2**20, 1), np.float32), y=np.zeros(2**20, np.uint8))
    assert path.stat().st_size < 64 * 2**10
    loaded: list[str] = []
    real_load = np.load
    monkeypatch.setattr(datafiles.np, "load", lambda *a, **k: loaded.append("np.load") or real_load(*a, **k))

    # Execute / Assert: refused by its declared size (4 MiB + 1 MiB + headers), nothing loaded
    with pytest.raises(DataError, match=r"bomb\.npz: its arrays x and y hold 5 MiB uncompressed, more than the 1 MiB"):
        load_file(path)
    assert loaded == []
