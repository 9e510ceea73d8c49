"""One bounded reader for a device's data file (issue 47, item 1): the task, the preflight and the agent alike.

Sizes are checked before anything is allocated (an NPZ's zip directory, then
each ``.npy`` header against the cap and against its member), values after:
features finite and within float32, labels in 0 .. MAX_LABEL. Each refusal is
one DataError line naming the file, the row and the column.
"""

from __future__ import annotations

import io
import math
import struct
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numpy.lib import format as npy

import learning.datafiles as datafiles
from deploy.preflight import check_data
from learning.datafiles import MAX_LABEL, read_npz
from learning.datasets import load_file
from learning.errors import DataError

MiB = 2**20


def npy_member(shape: tuple[int, ...], descr: str, data: bytes, fortran: bool = False) -> bytes:
    """A hand-made ``.npy`` file: numpy's own header, declaring whatever shape, then ``data`` as it is."""
    out = io.BytesIO()
    npy.write_array_header_1_0(out, {"descr": descr, "fortran_order": fortran, "shape": shape})
    return out.getvalue() + data


def write_npz(path: Path, members: dict[str, bytes], compression: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression) as archive:
        for name, payload in members.items():
            archive.writestr(name, payload)
    return path


def labels_member(n: int) -> bytes:
    out = io.BytesIO()
    np.save(out, np.zeros(n, np.int64))
    return out.getvalue()


@pytest.fixture
def peak_memory() -> Iterator[Callable[[], int]]:
    """Trace allocations (numpy's arrays included) from here on; the callable returns the peak so far, in bytes."""
    tracemalloc.start()
    try:
        yield lambda: tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ----------------------------------------------------------------- sizes


def test_the_preflight_refuses_a_zip_bomb_by_its_directory_without_decompressing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 64 MiB of zeros as x (2**24 float32), deflated to about 64 KiB, under an 8 MiB cap
    monkeypatch.setattr(datafiles, "MAX_NPZ_BYTES", 8 * MiB)
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("x.npy", "w") as member:
            member.write(npy_member((2**24,), "<f4", b""))
            zeros = bytes(MiB)
            for _ in range(64):
                member.write(zeros)
        archive.writestr("y.npy", labels_member(16))
    assert path.stat().st_size < MiB
    tracemalloc.start()

    # Execute
    try:
        warnings = check_data(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    # Assert: x.npy declares 128 + 2**26 bytes, y.npy 128 + 16 * 8: 64 MiB in all; nothing decompressed
    assert warnings == [f"--data {path}: its arrays x and y hold 64 MiB uncompressed, more than the 8 MiB a data "
                        "file may hold"]
    assert peak < 4 * MiB


def test_a_header_claiming_2_40_values_is_refused_before_allocating(tmp_path: Path,
                                                                   peak_memory: Callable[[], int]) -> None:
    # Prepare: 144 bytes of x.npy whose header claims 2**40 float64 values (8 TiB); the zip directory is honest
    path = write_npz(tmp_path / "liar.npz", {"x.npy": npy_member((2**40,), "<f8", bytes(16)),
                                             "y.npy": labels_member(2)})

    # Execute
    with pytest.raises(DataError) as info:
        load_file(path)
    warnings = check_data(path)

    # Assert: 2**40 * 8 bytes = 2**43 = 8,388,608 MiB, against the 1,024 MiB cap; the preflight says the same
    said = f"{path}: array 'x' declares shape (1099511627776,) of float64, 8,388,608 MiB, more than the 1,024 MiB " \
           "a data file may hold"
    assert str(info.value) == said
    assert warnings == [f"--data {said}"]
    assert peak_memory() < 4 * MiB


def test_a_header_claiming_more_than_its_member_holds_is_refused(tmp_path: Path) -> None:
    # Prepare: a header for 1,000 float64 values (8,000 bytes, under the cap) followed by 16 bytes
    path = write_npz(tmp_path / "short.npz", {"x.npy": npy_member((1000,), "<f8", bytes(16)),
                                              "y.npy": labels_member(1000)})

    # Execute
    with pytest.raises(DataError) as info:
        load_file(path)

    # Assert
    assert str(info.value) == (f"{path}: array 'x' declares shape (1000,) of float64 (8,000 bytes) but its member "
                               "x.npy holds 16 bytes after the header; save the file again")


def test_an_object_header_is_refused_without_unpickling(tmp_path: Path) -> None:
    # Prepare: a header declaring objects, followed by a pickle that would run code
    path = write_npz(tmp_path / "pickle.npz", {"x.npy": npy_member((1,), "|O", b"cos\nsystem\n(S'echo'\ntR."),
                                               "y.npy": labels_member(1)})

    # Execute / Assert
    with pytest.raises(DataError, match=r"^\S+pickle\.npz: array 'x' is not numeric \(dtype object\); save numbers"):
        load_file(path)


def test_fortran_order_big_endian_and_deflate_are_read_as_numpy_wrote_them(tmp_path: Path) -> None:
    # Prepare: x[i, j] = 10 i + j, stored column by column, big-endian; labels 0, 1, 2
    x = np.asfortranarray(np.array([[0, 1], [10, 11], [20, 21]], dtype=">f8"))
    path = tmp_path / "fortran.npz"
    np.savez_compressed(path, x=x, y=np.array([0, 1, 2], np.uint8))

    # Execute
    data = load_file(path)

    # Assert
    assert data.x.tolist() == [[0, 1], [10, 11], [20, 21]] and data.y.tolist() == [0, 1, 2]


# ---------------------------------------------------------------- values


@pytest.mark.parametrize(("cell", "shown"), [("1e39", "1e+39"), ("1e300", "1e+300"), ("-1e300", "-1e+300")])
def test_a_csv_feature_beyond_float32_is_named_by_line_and_column(tmp_path: Path, cell: str, shown: str) -> None:
    # Prepare: the value on the file's line 4 (a blank line 3 counts, as in an editor), column 'b'
    path = tmp_path / "wide.csv"
    path.write_text(f"a,b,label\n1,2,0\n\n3,{cell},1\n")

    # Execute
    with pytest.raises(DataError) as info:
        load_file(path)

    # Assert: the task and the preflight say the same line
    said = (f"{path}: line 4, column 'b': {shown} is beyond float32's range (±3.4e+38), where it becomes infinite; "
            "scale that feature, or remove the row")
    assert str(info.value) == said
    assert check_data(path) == [f"--data {said}"]


@pytest.mark.parametrize("value", [1e39, 1e300])
def test_an_npz_feature_beyond_float32_is_named_by_example_and_feature(tmp_path: Path, value: float) -> None:
    # Prepare: x of shape (3, 2, 2); the value at x[2, 1, 0], feature 1 * 2 + 0 = 2 of example 2
    x = np.zeros((3, 2, 2))
    x[2, 1, 0] = value
    path = tmp_path / "wide.npz"
    np.savez(path, x=x, y=np.array([0, 1, 0]))

    # Execute
    with pytest.raises(DataError) as info:
        load_file(path)

    # Assert
    assert str(info.value) == (f"{path}: example 2, feature 2: {value:g} is beyond float32's range (±3.4e+38), where "
                               "it becomes infinite; scale that feature, or remove the example")


def test_float32_largest_value_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "edge.npz"
    np.savez(path, x=np.array([[np.finfo(np.float32).max, -np.finfo(np.float32).max]]), y=np.array([MAX_LABEL]))
    data = load_file(path)
    assert np.isfinite(data.x).all() and data.y.tolist() == [1_048_575]


@pytest.mark.parametrize(("cell", "shown"), [("2e9", "2000000000"), ("1e12", "1000000000000"),
                                             ("1048576", "1048576")])
def test_a_csv_label_above_the_cap_is_named_by_line_and_value(tmp_path: Path, cell: str, shown: str) -> None:
    # Prepare: classes 0 .. 2**20 - 1 = 1,048,575 are allowed; the bad label is on line 3
    path = tmp_path / "labels.csv"
    path.write_text(f"a,label\n1,1048575\n2,{cell}\n")

    # Execute
    with pytest.raises(DataError) as info:
        load_file(path)

    # Assert
    assert str(info.value) == (f"{path}: line 3, column 'label': label {shown} is above 1,048,575, the largest a data "
                               "file may hold; number the classes 0, 1, 2, ...")


@pytest.mark.parametrize("y", [np.array([0.0, 1e12, 2.0]), np.array([0, 2_000_000_000, 2], np.int64)])
def test_an_npz_label_above_the_cap_is_named_by_example_and_value(tmp_path: Path, y: np.ndarray) -> None:
    path = tmp_path / "labels.npz"
    np.savez(path, x=np.zeros((3, 1)), y=y)
    with pytest.raises(DataError) as info:
        load_file(path)
    assert str(info.value) == (f"{path}: example 1: label {int(y[1])} is above 1,048,575, the largest a data file "
                               "may hold; number the classes 0, 1, 2, ...")


# ---------------------------------------------------- any file, one line

CAP = 64 * 2**10  # the cap under the property tests: 64 KiB

DESCRS = ["<f8", ">f4", "<f2", "<i8", "|u1", "|b1", "<c16", "|O", "<U3", "|V8", "<M8[s]", "<f8", "<i4"]
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e39, 1e300, -1e300, 2e9, 1e12]),
                   st.integers(-5, 5).map(float))
SIDES = st.one_of(st.integers(0, 6), st.integers(2**10, 2**14), st.integers(2**20, 2**62), st.integers(-3, -1))


@st.composite
def members(draw: st.DrawFn, shape: tuple[int, ...]) -> bytes:
    """One ``.npy`` member: a dtype and a shape (``shape`` or another), then values that fit, random bytes, or junk."""
    descr = draw(st.sampled_from(DESCRS))
    shape = draw(st.one_of(st.just(shape), st.lists(SIDES, max_size=3).map(tuple)))
    count = math.prod(shape) if all(side >= 0 for side in shape) else -1
    how = draw(st.sampled_from(["values", "values", "values", "bytes", "junk header", "cut preamble"]))
    if how == "junk header":
        return junk_header(draw(header_texts()), draw(st.binary(max_size=64)))
    if how == "cut preamble":
        return b"\x93NUMPY" + draw(st.binary(max_size=16))
    if how == "values" and 0 <= count <= 2**16 and descr[1] in "fiub":
        values = np.resize(np.array(draw(st.lists(VALUES, min_size=1, max_size=6))), count)  # repeated to fill
        with np.errstate(all="ignore"):  # casting 1e300 to float16 or NaN to an integer is the point
            data = values.astype(descr).tobytes()
    else:
        data = draw(st.binary(max_size=256))
    return npy_member(shape, descr, data, fortran=draw(st.booleans()))


JUNK = st.text(alphabet="{}()[]'\",: 0123456789-+.eTrueFalsNo<>|fiucbOVSUM*", max_size=24)


@st.composite
def header_texts(draw: st.DrawFn) -> str:
    """A header dictionary whose entries are each well formed or junk, or junk as a whole."""
    descr = draw(st.one_of(st.sampled_from(DESCRS).map(repr), JUNK))
    order = draw(st.one_of(st.sampled_from(["False", "True"]), JUNK))
    shape = draw(st.one_of(st.lists(SIDES, max_size=3).map(lambda sides: repr(tuple(sides))), JUNK))
    whole = f"{{'descr': {descr}, 'fortran_order': {order}, 'shape': {shape}, }}"
    return draw(st.one_of(st.just(whole), JUNK))


def junk_header(text: str, data: bytes) -> bytes:
    raw = text.encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(raw)) + raw + data


@st.composite
def npz_files(draw: st.DrawFn) -> dict[str, bytes]:
    """The members of an NPZ: mostly ``x`` (n examples of some shape) and ``y`` (n labels), sometimes not."""
    n = draw(st.one_of(st.integers(0, 4), st.integers(2**8, 2**12)))  # a few examples, or about the cap's worth
    example = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    names = draw(st.sampled_from([("x.npy", "y.npy")] * 3 + [("x.npy",), ("x.npy", "y.npy", "z.npy")]))
    return {name: draw(members((n, *example) if name == "x.npy" else (n,))) for name in names}


def assert_accepted_or_one_line(read: Callable[[], Any]) -> None:
    try:
        data = read()
    except DataError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    assert np.isfinite(data.x).all() and data.x.dtype == np.float32
    assert ((data.y >= 0) & (data.y <= MAX_LABEL)).all()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=npz_files(), deflate=st.booleans())
def test_any_npz_is_read_or_refused_in_one_line_within_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              files: dict[str, bytes], deflate: bool) -> None:
    # Prepare: any declared shapes, dtypes and sizes, under a 64 KiB cap
    monkeypatch.setattr(datafiles, "MAX_NPZ_BYTES", CAP)
    path = write_npz(tmp_path / "any.npz", files, zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
    tracemalloc.start()

    # Execute / Assert: a DataError of one line or checked data, never another exception, and little memory
    try:
        assert_accepted_or_one_line(lambda: load_file(path))
        assert all("\n" not in line for line in check_data(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * CAP


CELLS = st.one_of(VALUES.map(repr), st.sampled_from(["1e39", "-1e300", "nan", "inf", "", "n/a", "0x10", "1_0"]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(CELLS, CELLS, st.one_of(CELLS, st.integers(-2, 2**40).map(str))), max_size=5))
def test_any_csv_is_read_or_refused_in_one_line(tmp_path: Path, rows: list[tuple[str, str, str]]) -> None:
    path = tmp_path / "any.csv"
    path.write_text("a,b,label\n" + "".join(",".join(row) + "\n" for row in rows))
    assert_accepted_or_one_line(lambda: load_file(path))
    assert all("\n" not in line for line in check_data(path))


def test_read_npz_hands_out_x_in_its_stored_dtype_and_int64_labels(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.array([1, 2, 3], np.uint8), y=np.array([2.0, 0.0, 1.0]))
    x, y = read_npz(path)
    assert x.dtype == np.uint8 and x.shape == (3, 1) and y.dtype == np.int64 and y.tolist() == [2, 0, 1]
