"""The sections that describe what a scenario trains and how its rounds run.

``[data]``, ``[model]``, ``[federation]``, ``[training]``, ``[strategy]``,
``[evaluation]``, ``[async]`` and ``[task]``: one frozen dataclass each, whose
``_check`` validates the section's own keys (the combinations across sections
are refused by :class:`scenarios.schema.Scenario`; each strategy's own
``[strategy.<name>]`` table is a class of :mod:`scenarios.strategies`).
Import them from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from scenarios.bounds import MAX_CLIENTS, MAX_LR, MAX_ROUNDS, MAX_WAIT_S
from scenarios.parse import Bad, at_least, at_most, build, fraction, non_negative, positive, show, within
from scenarios.strategies import (
    LEGACY_DEFAULTS,
    STRATEGY_SETTINGS,
    FedAvgSettings,
    StrategySettings,
    legacy_value,
    setting_names,
)

__all__ = [
    "DataSpec", "ModelSpec", "FederationSpec", "TrainingSpec", "StrategySpec", "EvaluationSpec", "AsyncSpec",
    "TaskSpec", "MAX_ROUNDS", "MAX_CLIENTS", "ROBUST_STRATEGIES", "TASK_KEYS", "MAX_LOCAL_STEPS",
    "SHARED_STRATEGY_KEYS",
]

ROBUST_STRATEGIES = ("centered_clipping", "median", "trimmed_mean", "krum")


@dataclass(frozen=True)
class DataSpec:
    """``[data]``: the data set, how it is split among the clients, and the test splits."""

    dataset: Literal["mnist", "digits", "synthetic", "file"] = "mnist"
    # resample: each client draws samples_per_client examples with replacement, its label
    # proportions ~ Dirichlet(alpha); a client is materialised only when it is sampled.
    partition: Literal["iid", "dirichlet", "shards", "resample"] = "iid"
    alpha: float = 0.5
    shards_per_client: int = 2
    samples_per_client: int = 50
    server_test_fraction: float = 0.2
    client_test_fraction: float = 0.1
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    path: str = ""
    label_column: str = "label"
    # dataset = "file" without path: no data on the aggregator; every device's file has `features` columns
    # besides the label and labels 0 .. classes - 1 (the model is built from these)
    features: int = 0
    classes: int = 0
    # "federated": features scaled to zero mean, unit variance from a statistics pass before round 1
    # (learning.standardize; under [secagg] the server learns only the sums)
    standardize: Literal["none", "federated"] = "none"

    def _check(self) -> None:
        within("alpha", self.alpha, 0, 1e6, low_open=True)  # Dirichlet concentration: 1e6 is already IID
        positive("shards_per_client", self.shards_per_client)
        at_most("shards_per_client", self.shards_per_client, 10_000)
        positive("samples_per_client", self.samples_per_client)
        at_most("samples_per_client", self.samples_per_client, 1_000_000)
        if self.partition == "resample" and self.dataset == "synthetic":
            raise Bad("partition", self.partition, "does not apply to dataset = 'synthetic', which is naturally "
                      "partitioned (one device per client)")
        # a test split of 1.0 leaves nothing to train on
        fraction("server_test_fraction", self.server_test_fraction, allow_zero=True, allow_one=False)
        fraction("client_test_fraction", self.client_test_fraction, allow_zero=True, allow_one=False)
        for key in ("synthetic_alpha", "synthetic_beta"):  # standard deviations: the paper's are 0 to 1
            within(key, getattr(self, key), 0, 100)
        non_negative("features", self.features)
        at_most("features", self.features, 10_000_000)
        non_negative("classes", self.classes)
        at_most("classes", self.classes, 100_000)
        if self.dataset == "file" and not self.path and not (self.features and self.classes > 1):
            raise Bad("path", self.path, "is required when dataset = 'file', unless data.features and data.classes "
                      "(at least 2) describe the devices' own files: then the aggregator needs no data")


@dataclass(frozen=True)
class ModelSpec:
    """``[model]``: the built-in model to train."""

    name: Literal["logreg", "mlp", "cnn"] = "cnn"


@dataclass(frozen=True)
class FederationSpec:
    """``[federation]``: the clients, how many a round samples, and the limits on their replies."""

    clients: int = 10
    fraction: float = 1.0
    clients_per_round: int = 0
    min_clients: int = 1
    deadline_s: float = 120.0
    max_update_mb: float = 256.0
    # How much a client's update counts (core.weighting): "median" caps each example
    # count at median_cap x the round's median, "capped" at max_examples, "uniform" is 1.
    weighting: Literal["median", "capped", "uniform"] = "median"
    median_cap: float = 3.0
    max_examples: int = 100_000
    # A client update, or the round's step, longer than this x max(1, |model|) is rejected.
    max_update_ratio: float = 10.0
    # What the running sum of updates accumulates in: float64 makes the order of the sum not show
    # (a tree of edge sums and a flat sum then agree to ~1e-16), at twice the aggregator's buffer.
    accumulate: Literal["float32", "float64"] = "float32"

    def _check(self) -> None:
        positive("clients", self.clients)
        at_most("clients", self.clients, MAX_CLIENTS)
        fraction("fraction", self.fraction)
        non_negative("clients_per_round", self.clients_per_round)
        if self.clients_per_round > self.clients:
            raise Bad("clients_per_round", self.clients_per_round, f"exceeds clients = {self.clients}")
        positive("min_clients", self.min_clients)
        at_most("min_clients", self.min_clients, MAX_CLIENTS)
        positive("deadline_s", self.deadline_s)
        at_most("deadline_s", self.deadline_s, MAX_WAIT_S)
        positive("max_update_mb", self.max_update_mb)
        at_most("max_update_mb", self.max_update_mb, 65_536.0)
        at_least("median_cap", self.median_cap, 1.0)
        at_most("median_cap", self.median_cap, 1e6)
        positive("max_examples", self.max_examples)
        at_most("max_examples", self.max_examples, 10**9)
        positive("max_update_ratio", self.max_update_ratio)
        at_most("max_update_ratio", self.max_update_ratio, 1e6)

    @property
    def per_round(self) -> int:
        """Clients sampled per round."""
        if self.clients_per_round:
            return self.clients_per_round
        return max(1, round(self.fraction * self.clients))


#: The most local steps a round may ask of a client.
MAX_LOCAL_STEPS = 1_000_000


@dataclass(frozen=True)
class TrainingSpec:
    """``[training]``: each client's local work per round.

    ``local_epochs`` passes over its data or ``local_steps`` mini-batches
    (cycling the data); a file sets one of the two, never both.
    """

    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    local_steps: int | None = None

    @classmethod
    def from_table(cls, raw: Any, key: str) -> TrainingSpec:
        """``[training]`` as written: ``local_steps`` and an explicit ``local_epochs`` exclude each other."""
        spec: TrainingSpec = build(cls, raw, key + ".")
        if spec.local_steps is not None and "local_epochs" in raw:
            raise Bad(key + ".local_steps", spec.local_steps, f"{key}.local_epochs = {show(raw['local_epochs'])} is "
                      "set too: a round's local work is local_steps mini-batches or local_epochs passes; keep one")
        return spec

    def to_table(self) -> dict[str, Any]:
        """Return the section as :meth:`from_table` reads it back: without ``local_epochs`` when steps are set."""
        table = dataclasses.asdict(self)
        del table["local_epochs" if self.local_steps is not None else "local_steps"]
        return table

    @property
    def steps(self) -> int:
        """Local steps a round (0: ``local_epochs`` passes instead)."""
        return self.local_steps or 0

    def _check(self) -> None:
        positive("local_epochs", self.local_epochs)
        at_most("local_epochs", self.local_epochs, 10_000)
        if self.local_steps is not None:
            positive("local_steps", self.local_steps)
            at_most("local_steps", self.local_steps, MAX_LOCAL_STEPS)
        positive("batch_size", self.batch_size)
        at_most("batch_size", self.batch_size, 1_000_000)
        positive("lr", self.lr)
        at_most("lr", self.lr, MAX_LR)
        fraction("momentum", self.momentum, allow_zero=True, allow_one=False)


#: The keys of ``[strategy]`` every strategy reads; each strategy's own are in ``[strategy.<name>]``.
SHARED_STRATEGY_KEYS = ("name", "server_lr")


def _own_table(raw: Mapping[str, Any], key: str, name: str) -> Mapping[str, Any]:
    """Return the sub-table ``[strategy.<name>]`` (empty when absent), refusing anything but a table."""
    table = raw.get(name, {})
    if not isinstance(table, Mapping):
        raise Bad(f"{key}.{name}", table, f"must be a table (the settings of strategy {name!r})")
    return table


def _check_own_table(table: Mapping[str, Any], key: str, name: str) -> None:
    """Refuse a key of ``[strategy.<name>]`` that the strategy does not read, naming it."""
    chosen = setting_names(name)
    for k, value in table.items():
        if k not in chosen:
            why = (f"is read by every strategy: set it under [{key}]" if k in SHARED_STRATEGY_KEYS else
                   f"is not a setting of strategy {name!r} ({_settings_hint(key, name)})")
            raise Bad(f"{key}.{name}.{k}", value, why)


def _flat_settings(raw: Mapping[str, Any], key: str, name: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """Return the strategy's keys written flat under ``[strategy]`` (the form before the sub-tables).

    Another strategy's sub-table, a key set both flat and in the table,
    another strategy's key at a value other than its default, and an unknown
    key are refused, each named where it was written.
    """
    chosen, flat = setting_names(name), {}
    for k, value in raw.items():
        if k in SHARED_STRATEGY_KEYS or k == name:
            continue
        if k in STRATEGY_SETTINGS:
            raise Bad(f"{key}.{k}", value, f"are the settings of strategy {k!r}, and {key}.name = {name!r} "
                      f"would ignore them; {_settings_hint(key, name)}")
        if k in chosen and k in table:
            raise Bad(f"{key}.{k}", value, f"is set in [{key}.{name}] too ({k} = {show(table[k])}); keep the one "
                      "in the table")
        if k in chosen:
            flat[k] = value
        elif k in LEGACY_DEFAULTS:
            if legacy_value(k, value, key + ".") != LEGACY_DEFAULTS[k]:
                raise Bad(f"{key}.{k}", value, f"is not a setting of strategy {name!r}, which would ignore it "
                          f"({_settings_hint(key, name)}; docs/strategies.md)")
        else:
            raise Bad(f"{key}.{k}", value, f"unknown key; allowed: {', '.join(SHARED_STRATEGY_KEYS)} and the "
                      f"table [{key}.{name}] ({_settings_hint(key, name)})")
    return flat


@dataclass(frozen=True)
class StrategySpec:
    """``[strategy]``: the server's update rule, its learning rate and the rule's own settings (docs/strategies.md).

    ``settings`` is the chosen strategy's object of
    :data:`scenarios.strategies.STRATEGY_SETTINGS`, read from the sub-table
    ``[strategy.<name>]`` (:meth:`from_table`). A spec built in Python
    without ``settings`` gets the chosen strategy's defaults.
    """

    name: Literal["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox", "scaffold",
                  "centered_clipping", "median", "trimmed_mean", "krum"] = "fedavg"
    server_lr: float = 1.0
    settings: StrategySettings = field(default_factory=FedAvgSettings)

    def __post_init__(self) -> None:
        """Give a spec built without settings (or with another strategy's defaults) the chosen strategy's."""
        want = STRATEGY_SETTINGS[self.name]
        if type(self.settings) is not want:
            if self.settings != type(self.settings)():
                raise TypeError(f"strategy {self.name!r} takes {want.__name__}, not {self.settings!r}")
            object.__setattr__(self, "settings", want())  # the default of another strategy: this one's defaults

    @classmethod
    def from_table(cls, raw: Any, key: str) -> StrategySpec:
        """``[strategy]`` as written: ``name``, ``server_lr`` and the sub-table ``[strategy.<name>]``.

        A file (or a stored run) written before the sub-tables existed sets the
        strategy's keys directly under ``[strategy]``, every strategy's key at
        that: such a key still reads, into the settings when the chosen
        strategy reads it, and ignored when it is another strategy's at its
        default (:data:`scenarios.strategies.LEGACY_DEFAULTS`).

        Raises
        ------
        Bad
            A sub-table of another strategy, a key the chosen strategy does not
            read (in its sub-table, or flat at another value than its default),
            a key set both flat and in the sub-table, or a bad value, naming
            the key where it was written (``strategy.fedadam.beta1`` or
            ``strategy.beta1``).
        """
        if not isinstance(raw, Mapping):
            raise Bad(key, raw, "must be a table")
        spec: StrategySpec = build(cls, {k: v for k, v in raw.items() if k in SHARED_STRATEGY_KEYS}, key + ".")
        name = spec.name
        table = _own_table(raw, key, name)
        flat = _flat_settings(raw, key, name, table)
        _check_own_table(table, key, name)
        try:
            settings = build(STRATEGY_SETTINGS[name], {**flat, **table}, "")
        except Bad as bad:  # named where it was written: flat (a file of before the sub-tables) or in the table
            raise Bad((f"{key}." if bad.key in flat else f"{key}.{name}.") + bad.key, bad.value, bad.why) from None
        return dataclasses.replace(spec, settings=settings)

    def to_table(self) -> dict[str, Any]:
        """Return the section as :meth:`from_table` reads it back: the settings in ``[strategy.<name>]``."""
        table: dict[str, Any] = {"name": self.name, "server_lr": self.server_lr}
        settings = dataclasses.asdict(self.settings)
        if settings:
            table[self.name] = settings
        return table

    def _check(self) -> None:
        within("server_lr", self.server_lr, 0, MAX_LR, low_open=True)

    @property
    def robust(self) -> bool:
        """Whether the rule needs to see every client's update (no secure aggregation)."""
        return self.name in ROBUST_STRATEGIES


def _settings_hint(key: str, name: str) -> str:
    """Say which keys strategy ``name`` reads, and where."""
    own = setting_names(name)
    if not own:
        return f"strategy {name!r} reads {key}.server_lr only"
    return f"strategy {name!r} reads {key}.server_lr and, in [{key}.{name}], {', '.join(own)}"


@dataclass(frozen=True)
class EvaluationSpec:
    """``[evaluation]``: who scores the global model, and how often.

    Federated evaluation asks the round's ``clients`` (the ``"sampled"`` ones
    that answered, or ``"all"`` connected nodes); with ``fraction < 1`` a seeded
    sample of ``max(floor(fraction x n), min_clients)`` of them, as Flower's
    ``FedAvg`` samples with ``fraction_evaluate`` / ``min_evaluate_nodes``.
    """

    federated: bool = True
    server: bool = True
    every: int = 1
    clients: Literal["sampled", "all"] = "sampled"
    fraction: float = 1.0
    min_clients: int = 1

    def _check(self) -> None:
        positive("every", self.every)
        at_most("every", self.every, MAX_ROUNDS)
        fraction("fraction", self.fraction)
        positive("min_clients", self.min_clients)
        at_most("min_clients", self.min_clients, MAX_CLIENTS)


@dataclass(frozen=True)
class AsyncSpec:
    """``[async]``: buffered asynchronous aggregation (FedBuff) on the in-process engine's virtual clock.

    ``concurrency`` clients train at all times; every ``buffer_size`` replies,
    folded with weight ``staleness_weight(s)`` (``s``: server steps since the
    reply's model version), make one server step, stored like a round
    (``rounds`` counts steps). A reply staler than ``max_staleness`` is
    rejected. Training is real; time is simulated: a client's training takes
    ``base_time_s x local_epochs x`` its speed factor (lognormal with
    ``speed_sigma``, median 1; a ``stragglers`` fraction of the clients
    ``straggler_factor`` times slower) ``x`` a lognormal jitter per dispatch.
    ``clock = "wall"`` runs in real time instead (any engine, a deployment
    included): models are pushed as clients go idle and replies pulled as
    they arrive; the device-speed keys then do not apply.
    """

    enabled: bool = False
    clock: Literal["virtual", "wall"] = "virtual"
    concurrency: int = 10
    buffer_size: int = 5
    max_staleness: int = 20
    staleness: Literal["sqrt", "constant"] = "sqrt"   # 1 / sqrt(1 + s), or 1
    base_time_s: float = 1.0
    speed_sigma: float = 0.5
    jitter_sigma: float = 0.1
    stragglers: float = 0.0
    straggler_factor: float = 10.0

    def _check(self) -> None:
        within("concurrency", self.concurrency, 1, MAX_CLIENTS)
        within("buffer_size", self.buffer_size, 1, MAX_CLIENTS)
        within("max_staleness", self.max_staleness, 0, MAX_ROUNDS)
        positive("base_time_s", self.base_time_s)
        non_negative("speed_sigma", self.speed_sigma)
        non_negative("jitter_sigma", self.jitter_sigma)
        fraction("stragglers", self.stragglers, allow_zero=True, allow_one=False)
        at_least("straggler_factor", self.straggler_factor, 1.0)
        for key in ("speed_sigma", "jitter_sigma"):
            at_most(key, getattr(self, key), 5.0)
        at_most("straggler_factor", self.straggler_factor, 1e6)
        at_most("base_time_s", self.base_time_s, 1e9)
        if self.clock == "wall" and self.stragglers:
            raise Bad("stragglers", self.stragglers, "simulates slow devices on the virtual clock; with "
                       "clock = \"wall\" every device takes its real time (set stragglers = 0)")


#: Keys of ``[task]`` that Quorum reads; every other key goes to the task itself.
TASK_KEYS = ("entry", "path", "source", "options")


@dataclass(frozen=True)
class TaskSpec:
    """``[task]``: the task that trains (``entry = "package.module:Class"``) and the task's own keys.

    Without ``entry`` the built-in classification task runs on ``[data]`` and
    ``[model]``. ``path`` is a folder put on the import path before ``entry``
    is imported, relative to the scenario file's folder (the default); a
    scenario read from a file keeps it absolute, so the scenario can travel
    (run config, store) and still find its task. ``source`` is the file the
    section came from, named in errors. Every other key of the table is kept
    in ``options`` and validated against the schema the task declares
    (``learning.task``) when the task is loaded.
    """

    entry: str = ""
    path: str = ""
    source: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_table(cls, raw: Any, key: str) -> TaskSpec:
        """``[task]``: Quorum's keys as a section, every other key (or an ``options`` table) kept for the task."""
        if not isinstance(raw, Mapping):
            raise Bad(key, raw, "must be a table")
        options = raw.get("options", {})
        if not isinstance(options, Mapping):
            raise Bad(key + ".options", options, "must be a table")
        own = {k: v for k, v in raw.items() if k in TASK_KEYS and k != "options"}
        spec: TaskSpec = build(cls, own, key + ".")
        return dataclasses.replace(spec, options={**options, **{k: v for k, v in raw.items() if k not in TASK_KEYS}})

    def _check(self) -> None:
        if self.entry and not _is_entry(self.entry):
            raise Bad("entry", self.entry, "must be \"package.module:Class\" (a module path, a colon, a name)")
        if self.path and not self.entry:
            raise Bad("path", self.path, "needs an entry to import")


def _is_entry(entry: str) -> bool:
    module, sep, name = entry.partition(":")
    return bool(sep) and name.isidentifier() and all(part.isidentifier() for part in module.split("."))
