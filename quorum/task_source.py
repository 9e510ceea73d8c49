"""An export's own copy of its task's source: ``quorum export`` writes it, ``quorum.load_model`` imports it.

What is copied (:func:`task_sources`): the Python modules that loading the task
brought in from the task's own folder. That folder is ``[task] path`` (the
project folder ``quorum new`` writes; the scenario's folder by default) or,
for an entry imported from the import path, the entry module's package. A
module counts when it was loaded from that folder under its own name
(``helpers`` from ``FOLDER/helpers.py``, ``pkg.util`` from
``FOLDER/pkg/util.py``, with the ``__init__.py`` of its packages), from a
``.py`` file, and its top-level name is neither one of the packages beside
Quorum's own (``learning``, ``tests``, ... in a checkout) nor that of an
installed distribution (Quorum, torch, numpy, ...): those are installed
wherever the export is served. ``quorum export`` collects them after it has built the model, wrapped
it for serving and read the data its input shape comes from, so every module
that path imports is in; a module the task imports only later (inside
``train``) is not, and neither are data files. Quorum's built-in tasks copy
nothing. At most :data:`MAX_SOURCE_BYTES` are copied.

Loading (:func:`imported_from`) makes the copied modules importable by their
own names, from the copy only (a finder that knows exactly the recorded
files, checked against their SHA-256), while the task is rebuilt; then it moves
them under a private name (``_quorum_export_<digest>_<n>.task``) and puts back
whatever those names meant before. Two exports whose tasks are both
``task.py`` load side by side, and neither disturbs a ``task`` module the
process already had. Loading an export runs its task's code: load only exports
you trust.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import itertools
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

from quorum.errors import ExportError

__all__ = ["task_sources", "write_sources", "imported_from", "SOURCE", "MAX_SOURCE_BYTES"]

#: The export's folder that holds the copy.
SOURCE = "source"
#: The most bytes of task source an export copies.
MAX_SOURCE_BYTES = 8 * 2**20

#: The folder Quorum's own packages are imported from: none of them is copied, whether installed or not.
_QUORUM_ROOT = Path(__file__).resolve().parents[1]
_LOCK = threading.Lock()  # the import system is process-wide state: one export loads at a time
_LOADS = itertools.count(1)


def task_sources(entry: str, path: str) -> dict[str, Path]:
    """Return the task's own modules, loaded by now: relative path in the copy (``pkg/util.py``) -> the file.

    ``entry`` is the task's ``module:Class`` and ``path`` its ``[task] path``
    (or ``""``). Empty for a built-in task (Quorum is installed) or a task installed as a distribution.
    """
    module_name = entry.partition(":")[0]
    roots: list[tuple[Path, Callable[[str], bool]]] = []  # a folder, and which module names it may give
    if path:
        roots.append((Path(path).resolve(), lambda _name: True))
    entry_root = _import_root(module_name)
    if entry_root is not None and not any(root == entry_root for root, _ in roots):
        package = module_name.rpartition(".")[0] or module_name  # the entry's package, or the entry alone
        parents = {module_name.rsplit(".", i)[0] for i in range(1, module_name.count(".") + 1)}
        roots.append((entry_root, lambda name: name in parents or name == package or name.startswith(package + ".")))
    installed = _installed_tops()
    found: dict[str, Path] = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        top = name.split(".")[0]
        if not file or not str(file).endswith(".py") or top in installed or (_QUORUM_ROOT / top).is_dir():
            continue
        for root, wanted in roots:
            relative = _relative(name, Path(file), root) if wanted(name) else None
            if relative is not None:
                found[relative] = Path(file)
    return found


def _import_root(module_name: str) -> Path | None:
    """Return the import-path folder the loaded module ``module_name`` came from, or ``None``."""
    file = getattr(sys.modules.get(module_name), "__file__", None)
    if not file:
        return None
    folder = Path(file).resolve().parent
    depth = module_name.count(".") + (1 if Path(file).name == "__init__.py" else 0)
    for _ in range(depth):
        folder = folder.parent
    return folder


def _relative(name: str, file: Path, root: Path) -> str | None:
    """``name``'s file relative to ``root`` when ``root`` gives ``name`` by that file, else ``None``."""
    expected = root.joinpath(*name.split("."))
    resolved = file.resolve()
    for candidate in (expected.with_suffix(".py"), expected / "__init__.py"):
        if resolved == candidate:
            return candidate.relative_to(root).as_posix()
    return None


@functools.cache
def _installed_tops() -> frozenset[str]:
    return frozenset(importlib.metadata.packages_distributions())


def write_sources(files: Mapping[str, Path], out: Path) -> dict[str, Any]:
    """Copy ``files`` into ``out/source``; the manifest's ``source`` section (folder and each file's SHA-256).

    Raises
    ------
    ExportError
        More than :data:`MAX_SOURCE_BYTES` to copy, or a file that cannot be read.
    """
    try:
        contents = {relative: file.read_bytes() for relative, file in sorted(files.items())}
    except OSError as exc:
        raise ExportError(f"cannot copy the task's source: {exc}") from None
    size = sum(len(data) for data in contents.values())
    if size > MAX_SOURCE_BYTES:
        biggest = max(contents, key=lambda k: len(contents[k]))
        raise ExportError(f"the task's modules are {size:,} bytes, over the {MAX_SOURCE_BYTES:,} an export copies "
                          f"(largest: {files[biggest]}); keep the task's folder to its code")
    recorded = {}
    for relative, data in contents.items():
        target = out / SOURCE / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        recorded[relative] = hashlib.sha256(data).hexdigest()
    return {"folder": SOURCE, "files": recorded}


class _CopyFinder(importlib.abc.MetaPathFinder):
    """Finds exactly the copied modules (and the folders above them, as packages), nothing else."""

    def __init__(self, modules: Mapping[str, Path], namespaces: Mapping[str, Path]) -> None:
        self.modules, self.namespaces = modules, namespaces

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,  # noqa: ARG002 (MetaPathFinder's)
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:  # noqa: ARG002
        file = self.modules.get(fullname)
        if file is not None:
            package = [str(file.parent)] if file.name == "__init__.py" else None
            return importlib.util.spec_from_file_location(fullname, file, submodule_search_locations=package)
        folder = self.namespaces.get(fullname)
        if folder is not None:  # a folder without __init__.py: a namespace package of the copy alone
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = [str(folder)]
            return spec
        return None


def _checked(folder: Path, section: Any) -> tuple[Path, dict[str, Path]]:
    """Return the copy's folder, and its files by module name, each checked against the manifest's SHA-256."""
    files = section.get("files") if isinstance(section, dict) else None
    name = section.get("folder") if isinstance(section, dict) else None
    if not isinstance(files, dict) or not isinstance(name, str) or PurePosixPath(name).name != name or not name:
        raise ExportError(f"{folder}: the manifest's source section {section!r} is not a list of files")
    base = folder / name
    modules: dict[str, Path] = {}
    for relative, digest in files.items():
        parts = PurePosixPath(relative).parts
        if not relative.endswith(".py") or not parts or not all(p.removesuffix(".py").isidentifier() for p in parts):
            raise ExportError(f"{folder}: source file {relative!r} is not a module path")
        file = base.joinpath(*parts)
        try:
            data = file.read_bytes()
        except OSError:
            raise ExportError(f"{file}: the export's copy of the task's source is missing") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise ExportError(f"{file}: not the source the manifest names (SHA-256 differs)")
        dotted = [*parts[:-1], parts[-1].removesuffix(".py")]
        modules[".".join(dotted[:-1] if dotted[-1] == "__init__" else dotted)] = file
    return base, modules


@contextmanager
def imported_from(folder: Path, section: Any) -> Iterator[None]:
    """Within the block, the modules the manifest's ``source`` section lists import from ``folder``'s copy.

    Raises
    ------
    ExportError
        A listed file is missing or differs from its recorded SHA-256.
    """
    base, modules = _checked(folder, section)
    namespaces: dict[str, Path] = {}  # the folders above the copied files that are no package of their own
    for file in modules.values():
        parts = file.relative_to(base).parts[:-1]
        for i in range(1, len(parts) + 1):
            if ".".join(parts[:i]) not in modules:
                namespaces[".".join(parts[:i])] = base.joinpath(*parts[:i])
    tops = {name.split(".")[0] for name in modules}
    digest = hashlib.sha256("".join(sorted(str(d) for d in section["files"].values())).encode()).hexdigest()

    def ours(name: str) -> bool:
        return name.split(".")[0] in tops

    with _LOCK:
        saved = {name: sys.modules.pop(name) for name in list(sys.modules) if ours(name)}
        finder, bytecode = _CopyFinder(modules, namespaces), sys.dont_write_bytecode
        sys.meta_path.insert(0, finder)
        sys.dont_write_bytecode = True  # leave the export's folder as it was written
        importlib.invalidate_caches()
        try:
            yield
        finally:
            sys.meta_path.remove(finder)
            sys.dont_write_bytecode = bytecode
            private = f"_quorum_export_{digest[:12]}_{next(_LOADS)}"
            for name in [n for n in sys.modules if ours(n)]:
                sys.modules[f"{private}.{name}"] = sys.modules.pop(name)
            sys.modules.update(saved)
