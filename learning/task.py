"""The task interface: the unit a user writes to federate their own model, data and training code.

A task builds the model, says which of its tensors train (only those travel
and are aggregated: frozen layers and buffers never leave the device), loads a
client's local data, trains for one round and evaluates, reporting named
metrics. A scenario names its task by import path::

    [task]
    entry = "my_task:MyTask"   # module:Class, imported with the scenario's folder on the path
    hidden = 64                # the task's own keys, checked against MyTask.Options

Without ``[task]`` a scenario gets the built-in classification task
(``learning.tasks.classification``) on its ``[data]`` and ``[model]``; the
built-ins are tasks like any other, loaded through the same entry mechanism.
The round loop, secure aggregation, DP, the store and the dashboard see only
the flat vector of trainable parameters and the task's metrics.
"""

from __future__ import annotations

import importlib
import math
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
from torch import nn

from core.headline import Headline, headline_of
from core.instructions import TrainConfig
from learning.errors import TaskError
from learning.models import get_trainable_flat, set_trainable_flat, trainable_names
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, build_options
from scenarios.sections import TaskSpec

__all__ = ["Task", "LocalData", "Split", "NoOptions", "TaskModel", "Metrics", "BUILTIN_ENTRY", "load_task",
           "serving_task", "task_class", "check_metrics", "task_headline", "REQUIRED_METHODS"]

#: The task a scenario without ``[task] entry`` runs.
BUILTIN_ENTRY = "learning.tasks.classification:ClassificationTask"
#: What a task class must define (a subclass of :class:`Task` or any class with these methods).
REQUIRED_METHODS = ("build_model", "partition", "train", "evaluate")

#: Named metrics a task reports: plain floats (``num_examples`` a count).
Metrics = dict[str, float]


@dataclass(frozen=True)
class NoOptions:
    """The options of a task without keys of its own: ``[task]`` holds only ``entry`` (and ``path``)."""


class LocalData(Protocol):
    """One client's data: what it trains on and what it evaluates on (any types the task understands)."""

    @property
    def train(self) -> Any:
        """The data the client trains on."""
        ...

    @property
    def test(self) -> Any:
        """The data the client evaluates on."""
        ...


@dataclass(frozen=True)
class Split:
    """A ready-made :class:`LocalData`: a training part and a test part."""

    train: Any
    test: Any


class Task(ABC):
    """What a user writes: model, trainable parameters, local data, train, evaluate.

    A subclass declares its scenario keys as a frozen dataclass ``Options``
    (types and defaults; an optional ``_check`` raising
    :func:`scenarios.schema.bad_value` bounds them); the scenario's ``[task]``
    keys are validated against it and handed to ``__init__``.

    Metrics are plain ``dict[str, float]``: :meth:`train` reports at least
    ``loss`` and ``num_examples``; :meth:`evaluate` at least ``loss`` and
    ``num_examples``, plus whatever the task defines (``accuracy``, ``mae``,
    ``auc``, ``perplexity``, ...). The dashboard and reports show every one,
    the one named by ``headline_metric`` first.
    """

    #: The task's own ``[task]`` keys: a frozen dataclass with a default for each.
    Options: ClassVar[type] = NoOptions
    #: Whether ``[dp] local_dp_sgd`` may replace :meth:`train` (DP-SGD is a cross-entropy loop on ``x``/``y``).
    supports_dp_sgd: ClassVar[bool] = False
    #: Whether :meth:`train` takes ``config.steps`` optimiser steps when it is > 0 (``[training] local_steps``);
    #: a scenario that sets local steps for a task that does not say so is refused, not silently run by epochs.
    supports_local_steps: ClassVar[bool] = False
    #: The metric the task is judged by, shown first on every surface (the round line, ``quorum runs``, the
    #: dashboard, ``/metrics``, reports, export manifests): a name :meth:`evaluate` returns, or a
    #: ``(name, "up" | "down")`` pair saying which way is better (a bare name is ``down`` for errors and losses:
    #: ``mae``, ``rmse``, ``perplexity``, ...). ``None``: ``accuracy``, higher is better.
    headline_metric: ClassVar[str | tuple[str, str] | None] = None

    def __init__(self, options: Any, scenario: Scenario) -> None:
        self.options = options
        self.scenario = scenario

    @abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """Build a fresh model, initialised from ``seed`` (or from a pretrained checkpoint: the start of fine-tuning).

        Every node and the aggregator call it with the run's seed, so frozen
        tensors agree everywhere without travelling.
        """

    def trainable(self, model: nn.Module) -> list[str]:
        """Names (``state_dict`` keys) of the tensors that train, travel and are aggregated, in order.

        By default the parameters with ``requires_grad``: freeze a layer with
        ``p.requires_grad_(False)`` in :meth:`build_model` and it stays on the device.
        """
        return trainable_names(model)

    @abstractmethod
    def partition(self, partition_id: int) -> LocalData:
        """Return the local data of simulated client ``partition_id`` (``0 .. federation.clients - 1``)."""

    def device_data(self, path: str) -> LocalData:
        """Return the local data of a real device, read from ``path`` on that device (never leaves it)."""
        raise TaskError(f"{type(self).__name__} cannot read a device's own data (data-path = {path!r}); "
                        "define device_data(path) in the task")

    def server_data(self) -> Any | None:
        """Return the aggregator's held-out evaluation set, or ``None`` (no server-side evaluation)."""
        return None

    @abstractmethod
    def train(self, model: nn.Module, data: Any, config: TrainConfig, seed: int) -> Metrics:
        """Train ``model`` in place on ``data`` (a :class:`LocalData` ``train`` part) for one round.

        ``config`` carries the round's ``epochs``, ``batch_size``, ``lr``,
        ``momentum`` and ``proximal_mu`` (FedProx), and ``steps``: when > 0,
        take that many optimiser steps (mini-batches, cycling the data)
        instead of ``epochs`` passes, and set ``supports_local_steps = True``.
        ``seed`` is this client's seed for the round. Return at least ``loss``
        and ``num_examples``.
        """

    @abstractmethod
    def evaluate(self, model: nn.Module, data: Any) -> Metrics:
        """Score ``model`` on ``data``: at least ``loss`` and ``num_examples``, plus named metrics."""

    def serving_module(self, model: nn.Module) -> nn.Module:
        """Return the module ``quorum export`` writes and ``quorum serve`` runs, around the trained ``model``.

        It maps inputs as a user holds them to outputs in the task's own
        units: wrap ``model`` with the preprocessing the task's data loader
        applies (as registered buffers, so they travel in the export's
        ``safetensors``). By default the model itself.
        """
        return model


def check_metrics(metrics: Any, method: str, task: object) -> Metrics:
    """Return a task's metrics as finite floats, with ``loss`` and ``num_examples`` present.

    Raises
    ------
    TaskError
        Not a mapping of names to numbers, ``loss`` or ``num_examples`` missing,
        or a value that is not a finite number; the message names the task and the method.
    """
    where = f"{type(task).__name__}.{method}"
    if not hasattr(metrics, "items"):
        raise TaskError(f"{where} returned {type(metrics).__name__}; expected a dict of named numbers")
    clean: Metrics = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
                or not math.isfinite(float(value)):
            raise TaskError(f"{where}: metric {key!r} = {value!r} is not a finite number")
        clean[key] = float(value)
    for key in ("loss", "num_examples"):
        if key not in clean:
            raise TaskError(f"{where} must report {key!r}; got {', '.join(sorted(clean)) or 'nothing'}")
    if clean["num_examples"] < 0 or clean["num_examples"] != int(clean["num_examples"]):
        raise TaskError(f"{where}: num_examples = {clean['num_examples']!r} is not a count")
    return clean


@dataclass
class TaskModel:
    """One model of a task with the tensors that travel fixed: the flat vector a round exchanges."""

    task: Task
    model: nn.Module
    names: tuple[str, ...]

    @classmethod
    def build(cls, task: Task, seed: int) -> TaskModel:
        """Build ``task``'s model from ``seed`` and fix the tensors that travel (``task.trainable``).

        Raises
        ------
        TaskError
            ``build_model`` returned something other than a torch ``nn.Module``.
        """
        model = task.build_model(seed)
        if not isinstance(model, nn.Module):
            raise TaskError(f"{type(task).__name__}.build_model returned {type(model).__name__}, not a torch "
                            "nn.Module")
        return cls(task, model, tuple(task.trainable(model)))

    def get_flat(self) -> np.ndarray:
        """Return the trainable tensors as one new 1-D float32 array (what travels)."""
        return get_trainable_flat(self.model, self.names)

    def set_flat(self, flat: np.ndarray) -> None:
        """Load the trainable tensors from ``flat``; frozen ones keep their values."""
        set_trainable_flat(self.model, flat, self.names)

    def train(self, data: Any, config: TrainConfig, seed: int) -> Metrics:
        """Train the model on ``data`` for one round with the task's ``train``; return its checked metrics."""
        return check_metrics(self.task.train(self.model, data, config, seed), "train", self.task)

    def evaluate(self, data: Any) -> Metrics:
        """Score the model on ``data`` with the task's ``evaluate``; return its checked metrics."""
        return check_metrics(self.task.evaluate(self.model, data), "evaluate", self.task)


_LOCK = threading.Lock()
_TASKS: dict[int, tuple[Scenario, Task]] = {}  # keyed by id(); the scenario is kept so the id stays its own


def load_task(scenario: Scenario) -> Task:
    """Return the scenario's task, built once per scenario object and process.

    Raises
    ------
    ScenarioError
        The entry cannot be imported or is no task, or a ``[task]`` key is
        unknown or has a bad value: the message names the file, key and value.
    """
    with _LOCK:
        cached = _TASKS.get(id(scenario))
        if cached is not None and cached[0] is scenario:
            return cached[1]
        task = _instantiate(scenario)
        if len(_TASKS) >= 16:
            _TASKS.clear()
        _TASKS[id(scenario)] = (scenario, task)
        return task


def serving_task(scenario: Scenario) -> Task:
    """Return the scenario's task for serving its model: its options' own ``_check`` is not run.

    An export is loaded where the task's data are not (another host, a folder
    since deleted); serving needs only ``build_model`` and ``serving_module``.
    Names and types of the options are still checked. Not cached: a run's
    :func:`load_task` of the same scenario still checks everything.

    Raises
    ------
    ScenarioError
        As :func:`load_task`, but for what the options' ``_check`` would say.
    """
    return _instantiate(scenario, check_options=False)


def _instantiate(scenario: Scenario, check_options: bool = True) -> Task:
    spec = scenario.task
    cls = task_class(spec)
    options = build_options(getattr(cls, "Options", NoOptions), dict(spec.options), spec.source or scenario.name,
                            check=check_options)
    if scenario.dp.local_dp_sgd and not getattr(cls, "supports_dp_sgd", False):
        raise ScenarioError(f"{spec.source or scenario.name}: dp.local_dp_sgd = true: DP-SGD replaces the "
                            f"task's training loop, and {cls.__name__} does not allow it (supports_dp_sgd)")
    if scenario.training.local_steps is not None and not getattr(cls, "supports_local_steps", False):
        raise ScenarioError(f"{spec.source or scenario.name}: training.local_steps = {scenario.training.local_steps}: "
                            f"{cls.__name__}.train does not say it takes config.steps (supports_local_steps); "
                            "use training.local_epochs, or honour config.steps and set supports_local_steps = True")
    task_headline(cls, spec.source or scenario.name, spec.entry or BUILTIN_ENTRY)
    return cls(options, scenario)


def task_headline(task: object, source: str = "<scenario>", entry: str = "") -> Headline:
    """Return the headline metric ``task`` (a class or an instance) declares (:func:`core.headline.headline_of`).

    Raises
    ------
    ScenarioError
        A malformed ``headline_metric``, naming the file, the task's entry and the value.
    """
    try:
        return headline_of(task)
    except ValueError as exc:
        raise ScenarioError(f"{source}: task.entry = {entry!r}: {exc}") from None


def task_class(spec: TaskSpec) -> type[Task]:
    """Import ``spec.entry`` (``module:Class``), with ``spec.path`` first on the import path.

    Raises
    ------
    ScenarioError
        Naming the file, ``task.entry`` and why it cannot be used.
    """
    entry = spec.entry or BUILTIN_ENTRY
    module_name, _, class_name = entry.partition(":")

    def bad(why: str) -> ScenarioError:
        return ScenarioError(f"{spec.source or '<scenario>'}: task.entry = {entry!r}: {why}")

    try:
        module = _import(module_name, spec.path)
    except Exception as exc:  # a user's module: any error while importing it is theirs to see
        raise bad(f"cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise bad(f"module {module_name!r} has no class {class_name!r}")
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise bad(f"{class_name} is not a task: no {', '.join(missing)} (see learning.task.Task)")
    return cls


def _import(module_name: str, path: str) -> Any:
    """Import ``module_name``; from ``path`` first when given, even if a module of that name came from elsewhere.

    Two projects made by ``quorum new`` both hold a ``task`` module: the
    scenario's own folder decides which one its entry means.
    """
    if not path:
        return importlib.import_module(module_name)
    folder = str(Path(path))
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    top = module_name.split(".")[0]
    origin = getattr(sys.modules.get(top), "__file__", None)
    here = (Path(folder) / top).exists() or (Path(folder) / f"{top}.py").exists()
    if here and origin is not None and not Path(origin).resolve().is_relative_to(Path(folder).resolve()):
        for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
            del sys.modules[name]  # the same name from another project's folder
    importlib.invalidate_caches()
    return importlib.import_module(module_name)
