"""A device's own data file, read within a cap: CSV with a header, or NPZ with arrays ``x`` and ``y``.

One reader serves the task (:func:`learning.datasets.load_file`), the device's
preflight (:func:`deploy.preflight.check_data`) and so the client agent, so a
file is refused by all of them alike, in one :class:`~learning.errors.DataError`
line naming the file, the row and the column, and the fix.

Every size is checked before memory is taken for it. A CSV is counted while it
is read (``/dev/zero`` has no size to trust). An NPZ's zip directory declares
each member's uncompressed size, and each member's ``.npy`` header declares
its shape and item size: both are checked against :data:`MAX_NPZ_BYTES` (and
the header against the member's declared size) before an array is allocated,
and a member is decompressed in chunks, never more than its header declares.
A few hundred bytes that claim 2**40 values, or a small archive of zeros that
expands to gigabytes, cost nothing. Object (pickled) arrays are never read.

Values are checked too: features must be finite and within float32's range
(beyond it ``astype(float32)`` makes them infinite and every round's loss NaN),
labels integers in 0 .. :data:`MAX_LABEL` (a label of 2e9 would make a one-hot
or a bincount of 16 GB).
"""

from __future__ import annotations

import csv
import math
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TextIO

import numpy as np
from numpy.lib import format as npy

from learning.errors import DataError

__all__ = ["MAX_CSV_BYTES", "MAX_NPZ_BYTES", "MAX_LABEL", "FLOAT32_MAX", "read_data", "read_csv", "read_npz",
           "csv_header"]

#: The largest CSV data file read (counted while reading: ``/dev/zero`` has no size to trust).
MAX_CSV_BYTES = 256 * 2**20
#: The most an ``.npz`` data file's ``x`` and ``y`` may hold uncompressed, by its zip directory and by the
#: ``.npy`` headers of its arrays (a small archive of zeros can expand to any size).
MAX_NPZ_BYTES = 2**30
#: The largest label: classes are numbered 0 .. MAX_LABEL (about a million), so a one-hot or a count per class
#: of a file's labels stays small.
MAX_LABEL = 2**20 - 1
#: The largest magnitude a feature may have: float32's largest finite value (about 3.4e38).
FLOAT32_MAX = float(np.finfo(np.float32).max)

#: The most bytes asked of a zip member at once: zipfile decompresses as much as one read asks for, whatever
#: the member's declared size.
_CHUNK = 2**20
#: Room for an ``.npy`` preamble: magic (8 bytes), header length (4) and numpy's largest safe header (10,000).
_HEADER_ROOM = 8 + 4 + 10_000
#: Elements looked at per block when checking features (bounds the temporaries of a large ``x``).
_BLOCK = 2**20
#: What a damaged zip member raises while it is read.
_BAD_MEMBER = (OSError, EOFError, ValueError, TypeError, SyntaxError, RecursionError, OverflowError,
               RuntimeError, NotImplementedError, zipfile.BadZipFile, zlib.error)

#: Where a value sits, for an error message: ``(row, column) -> "line 5, column 'a'"``.
Locate = Callable[[int, int], str]


def read_data(path: str | Path, label_column: str = "label") -> tuple[np.ndarray, np.ndarray]:
    """Read a device's data file as features ``x`` (float32, first axis = example) and labels ``y`` (int64).

    CSV features are every column but ``label_column``, giving ``(N, F)``; NPZ
    ``x`` keeps its shape after the first axis.

    Raises
    ------
    DataError
        One line naming the file and the problem, and where it is.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        _, x, y = read_csv(path, label_column)
    elif suffix == ".npz":
        x, y = read_npz(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected .csv or .npz")
    return x.astype(np.float32), y


# ------------------------------------------------------------------------ CSV


def read_csv(path: str | Path, label_column: str = "label") -> tuple[list[str], np.ndarray, np.ndarray]:
    """Read a CSV data file's feature names, features ``(N, F)`` (float64) and labels (int64).

    Raises
    ------
    DataError
        One line naming the file, the line (as an editor numbers it) and the
        column of the first problem, and the fix.
    """
    path = Path(path)
    lines, rows = _csv_rows(path)
    header = _csv_header_of(path, rows, label_column)
    for line, row in zip(lines[1:], rows[1:], strict=True):
        if len(row) != len(header):
            raise DataError(f"{path}: line {line} has {len(row)} values, the header has {len(header)}: "
                            f"{_ragged(header, row)}")
    table = _numeric_table(path, header, lines[1:], rows[1:])
    label = header.index(label_column)
    names = [h for h in header if h != label_column]
    y = _labels(path, table[:, label], lambda row, _: f"line {lines[1 + row]}, column {label_column!r}")
    x = np.delete(table, label, axis=1)
    _check_features(path, x, lambda row, col: f"line {lines[1 + row]}, column {names[col]!r}", "row")
    return names, x, y


def _csv_header_of(path: Path, rows: list[list[str]], label_column: str) -> list[str]:
    """Return the header row, once it names the label column and another column, and data rows follow."""
    if not rows:
        raise DataError(f"{path}: file is empty")
    header = rows[0]
    if label_column not in header:
        raise DataError(f"{path}: no label column {label_column!r}; columns are {', '.join(header)}")
    if len(header) < 2:
        raise DataError(f"{path}: no feature columns besides {label_column!r}")
    if len(rows) == 1:
        raise DataError(f"{path}: no data rows after the header")
    return header


def _ragged(header: list[str], row: list[str]) -> str:
    """Which column a row with the wrong number of values lacks, or what it holds beyond the header."""
    if len(row) < len(header):
        return (f"column {header[len(row)]!r}" + (" and the ones after it are" if len(row) < len(header) - 1
                                                  else " is") + " empty there; fill them in, or remove the row")
    return (f"{len(row) - len(header)} value(s) after the last column {header[-1]!r} ({row[len(header)][:20]!r}) "
            "have no column; give that column a name in the header, or remove the values")


def csv_header(path: str | Path) -> list[str]:
    """Return a CSV file's column names (its first non-blank row); ``[]`` when it has none or cannot be read."""
    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:
            return next(([cell.strip() for cell in row] for row in csv.reader(_capped_lines(handle, path)) if row),
                        [])
    except (OSError, UnicodeDecodeError, csv.Error, DataError):
        return []


def _capped_lines(handle: TextIO, path: Path) -> Iterator[str]:
    """Yield ``handle``'s lines, refusing the file once it holds more than :data:`MAX_CSV_BYTES` characters."""
    budget = MAX_CSV_BYTES
    while line := handle.readline(budget + 1):  # a line never runs past the cap, even one without an end
        budget -= len(line)
        if budget < 0:
            raise DataError(f"{path}: larger than {MAX_CSV_BYTES // 2**20} MiB, the most a CSV data file may hold")
        yield line


def _csv_rows(path: Path) -> tuple[list[int], list[list[str]]]:
    lines, rows = [], []
    try:
        with path.open(newline="", encoding="utf-8-sig") as handle:  # tolerate a BOM
            reader = csv.reader(_capped_lines(handle, path))
            for row in reader:
                if row:  # blank lines carry nothing
                    lines.append(reader.line_num)
                    rows.append([cell.strip() for cell in row])
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror})") from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{path}: not a readable CSV text file ({exc})") from None
    return lines, rows


def _numeric_table(path: Path, header: list[str], lines: list[int], rows: list[list[str]]) -> np.ndarray:
    try:
        return np.array(rows, dtype=np.float64)
    except ValueError:
        line, column, cell = _first_non_numeric(lines, rows)
        raise DataError(f"{path}: line {line}, column {header[column]!r}: {cell!r} is not a number; write a number "
                        "there, or remove the row") from None


def _first_non_numeric(lines: list[int], rows: list[list[str]]) -> tuple[int, int, str]:
    for line, row in zip(lines, rows, strict=True):
        for column, cell in enumerate(row):
            try:
                float(cell)
            except ValueError:
                return line, column, cell
    raise AssertionError("unreachable: numpy rejected a table that float() accepts")  # pragma: no cover


# ----------------------------------------------------------------- values


def _check_features(path: Path, x: np.ndarray, locate: Locate, row_word: str) -> None:
    """Refuse the first feature (in row order) that is NaN, infinite, or beyond float32's range."""
    if x.dtype.kind != "f" or not x.size:
        return  # integers and booleans are finite, and int64's largest (9.2e18) is well within float32's range
    rows = max(1, _BLOCK // (x.size // len(x) or 1))  # blocks of rows keep the temporaries small
    for start in range(0, len(x), rows):
        block = x[start:start + rows]
        # NaN compares False, so it is caught too; float16 and float32 values lie within float32 once finite
        bad = ~(np.abs(block) <= FLOAT32_MAX) if x.itemsize > 4 else ~np.isfinite(block)
        if bad.any():
            index = np.unravel_index(int(np.argmax(bad)), bad.shape)  # the first, in C order
            row, column = start + int(index[0]), int(np.ravel_multi_index(index[1:], bad.shape[1:]))
            raise DataError(f"{path}: {locate(row, column)}: {_bad_feature(float(x[row][index[1:]]), row_word)}")


def _bad_feature(value: float, row_word: str) -> str:
    """Say what is wrong with a feature's value, and the fix."""
    if not math.isfinite(value):
        return f"value is NaN or infinite; write a finite number there, or remove the {row_word}"
    return (f"{value:g} is beyond float32's range (±{FLOAT32_MAX:.1e}), where it becomes infinite; scale that "
            f"feature, or remove the {row_word}")


def _labels(path: Path, y: np.ndarray, locate: Locate) -> np.ndarray:
    """Return ``y`` as int64, refusing the first label that is not an integer in 0 .. :data:`MAX_LABEL`."""
    y = y.astype(np.float64) if y.dtype.kind == "f" else y  # float16 cannot hold MAX_LABEL: compare in float64
    whole = np.isfinite(y) & (y == np.floor(y)) if y.dtype.kind == "f" else np.ones(y.shape, bool)
    bad = ~whole | (y < 0) | (y > MAX_LABEL)
    if not bad.any():
        return y.astype(np.int64)
    row = int(np.argmax(bad))
    value = float(y[row])
    where = f"{path}: {locate(row, 0)}: label"
    if not whole[row] or value < 0:
        raise DataError(f"{where} {value:g} is not a non-negative integer; number the classes 0, 1, 2, ...")
    shown = f"{int(value)}" if value < 1e15 else f"{value:g}"
    raise DataError(f"{where} {shown} is above {MAX_LABEL:,}, the largest a data file may hold; number the "
                    "classes 0, 1, 2, ...")


# ------------------------------------------------------------------------ NPZ


def read_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read an NPZ data file's ``x`` (its stored dtype, at least 2-D) and labels ``y`` (int64), within the cap.

    Raises
    ------
    DataError
        One line naming the file and the problem: not a zip, arrays missing,
        not numeric, larger than :data:`MAX_NPZ_BYTES` (by the zip directory
        or by an ``.npy`` header, before anything is allocated), shapes that
        do not pair up, a feature not finite or beyond float32 (by example and
        feature), a label not in 0 .. :data:`MAX_LABEL` (by example).
    """
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as archive:
            members = _members(path, archive)
            x, y = (_read_member(path, archive, members[name], name) for name in ("x", "y"))
    except DataError:
        raise  # a ValueError too, already in its one line
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror or exc})") from None
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a valid .npz archive ({_one_line(exc)})") from None
    if y.ndim != 1 or x.ndim < 1 or x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: x has shape {x.shape} but y has shape {y.shape}; need one label per example")
    if len(y) == 0:
        raise DataError(f"{path}: file is empty (no examples)")
    x = x.reshape(-1, 1) if x.ndim == 1 else x
    _check_features(path, x, lambda row, col: f"example {row}, feature {col}", "example")
    return x, _labels(path, y, lambda row, _: f"example {row}")


def _members(path: Path, archive: zipfile.ZipFile) -> dict[str, zipfile.ZipInfo]:
    """Return the entries of ``x`` and ``y``, once the zip directory says they fit the cap."""
    members = {i.filename.removesuffix(".npy"): i for i in archive.infolist() if i.filename in ("x.npy", "y.npy")}
    declared = sum(i.file_size for i in archive.infolist() if i.filename in ("x.npy", "y.npy"))
    if declared > MAX_NPZ_BYTES:
        raise DataError(f"{path}: its arrays x and y hold {declared / 2**20:,.0f} MiB uncompressed, more than the "
                        f"{MAX_NPZ_BYTES / 2**20:,.0f} MiB a data file may hold")
    missing = sorted({"x", "y"} - set(members))
    if missing:
        found = sorted(name.removesuffix(".npy") for name in archive.namelist())
        shown = str(found[:8])[:-1] + (f", ... ({len(found)} arrays)]" if len(found) > 8 else "]")
        raise DataError(f"{path}: missing array {missing[0]!r}; found {shown}: an NPZ data file needs arrays 'x' "
                        "and 'y' (features and labels: np.savez(path, x=features, y=labels))")
    return members


class _Capped:
    """A zip member handed out in reads of at most :data:`_CHUNK` bytes, and at most ``left`` bytes in all."""

    def __init__(self, stream: IO[bytes], left: int) -> None:
        self.stream, self.left, self.taken = stream, left, 0

    def read(self, size: int = -1) -> bytes:
        """Read up to ``size`` bytes (all that is left when negative), at most :data:`_CHUNK` per step."""
        size = self.left if size < 0 else min(size, self.left)
        parts = []
        while size > 0 and (part := self.stream.read(min(size, _CHUNK))):
            parts.append(part)
            size -= len(part)
            self.left -= len(part)
            self.taken += len(part)
        return b"".join(parts)


def _read_member(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str) -> np.ndarray:
    """Read one array: its header first, checked, then exactly the bytes it declares."""
    if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise DataError(f"{path}: array {name!r} is encrypted or compressed with zip method {info.compress_type}; "
                        "save the file with np.savez or np.savez_compressed")
    try:
        with archive.open(info) as raw:
            member = _Capped(raw, _HEADER_ROOM)
            shape, fortran, dtype = _npy_header(member)
            count = _checked_count(path, name, shape, dtype, info.file_size - member.taken)
            member.left = count * dtype.itemsize
            values = _read_values(member, count, dtype)
        return values.reshape(shape[::-1]).transpose() if fortran else values.reshape(shape)
    except DataError:
        raise
    except _BAD_MEMBER as exc:
        raise DataError(f"{path}: not a valid .npz archive ({name}.npy: {_one_line(exc)})") from None


def _npy_header(member: _Capped) -> tuple[tuple[int, ...], bool, np.dtype[np.generic]]:
    """Parse a ``.npy`` preamble with numpy's own parser; nothing is allocated for the array.

    Raises
    ------
    ValueError
        The preamble is damaged: whatever numpy's parser raised on it, in its words.
    """
    version = npy.read_magic(member)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"npy format version {version[0]}.{version[1]} is not read; save with np.savez")
    parse = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a header written by Python 2 is parsed all the same
            shape, fortran, dtype = parse(member)
    except _BAD_MEMBER as exc:
        raise ValueError(_one_line(exc)) from None
    except Exception as exc:  # any text reaches ast and tokenize in there (TokenError, ...): a damaged header
        raise ValueError(f"{type(exc).__name__}: {_one_line(exc)}") from None
    return tuple(int(side) for side in shape), fortran, dtype


def _checked_count(path: Path, name: str, shape: tuple[int, ...], dtype: np.dtype[np.generic], room: int) -> int:
    """Return the count of values a header declares, once its dtype is numeric and it fits the cap and the member."""
    if dtype.kind not in "biuf":
        raise DataError(f"{path}: array {name!r} is not numeric (dtype {str(dtype)[:60]}); save numbers only: "
                        "np.savez(path, x=features, y=labels) with arrays of numbers")
    if any(side < 0 for side in shape):
        raise ValueError(f"shape {shape} has a negative side")
    nominal = math.prod(max(side, 1) for side in shape) * dtype.itemsize  # (0, 2**62) holds nothing, but is no data
    if nominal > MAX_NPZ_BYTES:
        raise DataError(f"{path}: array {name!r} declares shape {shape} of {dtype}, {nominal / 2**20:,.0f} MiB, more "
                        f"than the {MAX_NPZ_BYTES / 2**20:,.0f} MiB a data file may hold")
    count = math.prod(shape)
    size = count * dtype.itemsize
    if size > room:
        raise DataError(f"{path}: array {name!r} declares shape {shape} of {dtype} ({size:,} bytes) but its member "
                        f"{name}.npy holds {max(room, 0):,} bytes after the header; save the file again")
    return count


def _read_values(member: _Capped, count: int, dtype: np.dtype[np.generic]) -> np.ndarray:
    """Read ``count`` values of ``dtype`` into one array allocated once, chunk by chunk."""
    values = np.empty(count, dtype)
    raw = values.view(np.uint8)
    done = 0
    while done < raw.size:
        chunk = member.read(min(_CHUNK, raw.size - done))  # never the whole array as bytes at once
        if not chunk:
            raise EOFError(f"the array's bytes end after {done:,} of {raw.size:,}")
        raw[done:done + len(chunk)] = np.frombuffer(chunk, np.uint8)
        done += len(chunk)
    return values


def _one_line(exc: BaseException) -> str:
    """Return an exception's message on one line, cut to 160 characters (a damaged header may be long)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
