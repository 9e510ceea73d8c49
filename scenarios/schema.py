"""The scenario schema: frozen, validated dataclasses parsed once from TOML.

A scenario file describes a whole experiment: the data set and how it is split
over clients, the model, the federation, local training, the strategy, privacy
and the faults to inject. Every section is a frozen dataclass; parsing checks
every key and value and fails with one line naming the file, the key and the
value. Nothing is executed and nothing is mutated after parsing.

This module holds the top-level :class:`Scenario`, the checks that span
sections, and the loaders. The sections themselves live in
:mod:`scenarios.sections` (what is trained and how rounds run),
:mod:`scenarios.threats` (``[faults]``, ``[secagg]``, ``[dp]``) and
:mod:`scenarios.compression`: import each from its own module.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from scenarios.compression import CompressionSpec, check_compression
from scenarios.errors import ScenarioError
from scenarios.hierarchy import HierarchySpec, check_hierarchy
from scenarios.parse import Bad, at_least, at_most, build, positive, show, show_key
from scenarios.sections import (
    MAX_ROUNDS,
    AsyncSpec,
    DataSpec,
    EvaluationSpec,
    FederationSpec,
    ModelSpec,
    StrategySpec,
    TaskSpec,
    TrainingSpec,
)
from scenarios.strategies import CenteredClippingSettings, KrumSettings
from scenarios.threats import DPSpec, FaultSpec, SecAggSpec

__all__ = ["Scenario", "load_scenario", "loads_scenario", "scenario_from_dict", "build_options", "bad_value",
           "MAX_SCENARIO_BYTES"]


@dataclass(frozen=True)
class Scenario:
    """A whole experiment, as parsed from one TOML file."""

    name: str
    seed: int = 0
    rounds: int = 10
    description: str = ""
    data: DataSpec = field(default_factory=DataSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    federation: FederationSpec = field(default_factory=FederationSpec)
    training: TrainingSpec = field(default_factory=TrainingSpec)
    strategy: StrategySpec = field(default_factory=StrategySpec)
    evaluation: EvaluationSpec = field(default_factory=EvaluationSpec)
    faults: FaultSpec = field(default_factory=FaultSpec)
    secagg: SecAggSpec = field(default_factory=SecAggSpec)
    dp: DPSpec = field(default_factory=DPSpec)
    task: TaskSpec = field(default_factory=TaskSpec)
    asynchronous: AsyncSpec = field(default_factory=AsyncSpec)  # [async] in the file (a Python keyword)
    compression: CompressionSpec = field(default_factory=CompressionSpec)
    hierarchy: HierarchySpec = field(default_factory=HierarchySpec)

    #: Field name -> the key a file writes (and to_dict gives back).
    TOML_KEYS: ClassVar[dict[str, str]] = {"asynchronous": "async"}

    def _check(self) -> None:
        positive("rounds", self.rounds)
        at_most("rounds", self.rounds, MAX_ROUNDS)
        at_least("seed", self.seed, 0)
        at_most("seed", self.seed, 2**63 - 1)
        if self.federation.min_clients > self.federation.per_round:
            raise Bad("federation.min_clients", self.federation.min_clients,
                       f"exceeds the {self.federation.per_round} clients sampled per round")
        if self.dp.enabled and self.dp.placement == "distributed" and not self.secagg.enabled:
            # Without secure aggregation the server would see each update with noise z / sqrt(K) only.
            raise Bad("dp.placement", self.dp.placement, "needs secagg.enabled = true (each client's noise "
                       "share hides nothing from a server that sees single updates); use \"central\"")
        if self.dp.enabled and self.dp.mechanism == "discrete_gaussian":
            _check_discrete(self)
        if self.secagg.enabled and self.secagg.bits == 16 and self.federation.per_round > RING16_MAX_CLIENTS:
            raise Bad("secagg.bits", 16, f"a 16-bit ring sums at most {RING16_MAX_CLIENTS:,} clients without "
                       f"wrapping, and federation samples {self.federation.per_round:,} a round: use 32")
        if self.strategy.robust:
            _check_robust(self)
        if self.asynchronous.enabled:
            _check_async(self)
        check_compression(self)
        if self.federation.accumulate == "float64":
            _check_float64(self)
        if self.hierarchy.enabled:
            check_hierarchy(self)
        elif self.faults.edges:
            raise Bad("faults.edges", self.faults.edges, "makes edge aggregators vanish, and this federation has "
                       "none: set [hierarchy] edges")
        if self.data.standardize == "federated":
            _check_standardize(self)
        attack = self.faults.byzantine_spec
        if attack.data == "iid":
            _check_iid_attackers(self)
        if self.training.local_steps is not None and self.dp.local_dp_sgd:
            raise Bad("training.local_steps", self.training.local_steps, "dp.local_dp_sgd = true: DP-SGD's "
                       "accountant counts passes over the data (training.local_epochs); set one of the two")
        if self.strategy.name == "scaffold":
            check_scaffold(self)
        if attack.active and self.secagg.enabled:
            raise Bad("faults.byzantine.attack", attack.attack, "the attack harness forges plain train replies, "
                       "and [secagg] enabled = true masks them in protocol stages it does not drive; choose one")

    def with_overrides(self, **changes: Any) -> Scenario:
        """Return a copy with top-level values replaced (e.g. rounds, seed), re-validated."""
        return scenario_from_dict({**self.to_dict(), **changes}, source="<override>")

    def to_dict(self) -> dict[str, Any]:
        """Return the scenario as plain data, under the keys a file writes.

        ``async``, and ``[training]`` and ``[strategy]`` as they read back (the
        strategy's settings in ``[strategy.<name>]``).
        """
        out = {**dataclasses.asdict(self), "training": self.training.to_table(), "strategy": self.strategy.to_table()}
        return {self.TOML_KEYS.get(k, k): v for k, v in out.items()}


def _check_float64(scenario: Scenario) -> None:
    """Refuse float64 accumulation where no running sum is kept, naming both keys."""
    culprit = ("strategy.name", scenario.strategy.name, "is a robust rule, which keeps every update, not a sum") \
        if scenario.strategy.robust else \
        ("async.enabled", True, "FedBuff's buffer sums in float32") if scenario.asynchronous.enabled else \
        ("dp.enabled", True, "DP-FedAvg's clipped and noised sum is kept in float32 (its noise is far above "
         "float32's rounding)") if scenario.dp.enabled else None
    if culprit is not None:
        key, value, why = culprit
        raise Bad(key, value, f"federation.accumulate = \"float64\" keeps a running sum in float64, and {why}; "
                  "leave it \"float32\"")


def check_scaffold(scenario: Scenario) -> None:
    """Refuse what SCAFFOLD's control variates do not combine with, naming both keys.

    Its clients send a control delta beside the model delta, in one vector;
    secure aggregation sums that vector like any other, and a downlink codec
    only rounds the model the clients start from, so both compose.
    """
    name = ("strategy.name", "scaffold")
    dp, compression = scenario.dp, scenario.compression
    culprit = (
        ("[dp] enabled = true: DP-FedAvg clips and noises a model delta, and a SCAFFOLD client also releases "
         "its control delta, which that calibration does not cover") if dp.enabled else
        ("dp.local_dp_sgd = true: DP-SGD replaces the local SGD steps that SCAFFOLD corrects, and does not "
         "add the correction") if dp.local_dp_sgd else
        ("[compression] compresses the uplink: the control delta travels beside the model delta and is about "
         "local-steps times smaller, so top-k drops it and a shared quantisation scale rounds it away; keep "
         "downlink_bits only") if compression.uplink else
        ("faults.byzantine: the attack harness forges model deltas without the control delta a SCAFFOLD "
         "reply carries") if scenario.faults.byzantine_spec.active else None)
    if culprit is not None:
        raise Bad(*name, culprit)


def _check_async(scenario: Scenario) -> None:
    """Refuse what the buffered asynchronous mode does not combine with (yet), each naming both keys."""
    spec, fed = scenario.asynchronous, scenario.federation
    if spec.concurrency > fed.clients:
        raise Bad("async.concurrency", spec.concurrency, f"exceeds federation.clients = {fed.clients}")
    if spec.buffer_size > spec.concurrency:
        raise Bad("async.buffer_size", spec.buffer_size, f"exceeds async.concurrency = {spec.concurrency}: "
                   "the buffer could never fill from the clients in flight")
    if scenario.secagg.enabled:
        raise Bad("async.enabled", True, "[secagg] enabled = true: secure aggregation over an asynchronous "
                   "buffer needs a protocol of its own (the masks of one set of clients must cancel in one sum); "
                   "choose one")
    if scenario.dp.enabled:
        raise Bad("async.enabled", True, "[dp] enabled = true: a buffer release is a DP step only with its "
                   "sampling accounted, which the asynchronous mode does not do yet; choose one")
    if scenario.strategy.robust:
        raise Bad("async.enabled", True, f"strategy.name = {scenario.strategy.name!r} ranks or clips a round's "
                   "updates against each other, which a buffer of stale updates does not give; use fedavg, "
                   "fedavgm, fedadam, fedyogi or fedadagrad")
    if scenario.strategy.name == "scaffold":
        raise Bad("async.enabled", True, "strategy.name = 'scaffold': its server control variate moves by a "
                   "round's control deltas, which a buffer of stale replies made against older ones does not "
                   "give; use fedavg, fedavgm, fedadam, fedyogi or fedadagrad")
    attack = scenario.faults.byzantine_spec
    if attack.active:
        raise Bad("async.enabled", True, "the attack harness needs a round's honest updates (faults.byzantine)")
    faults = scenario.faults
    if any(faults.dropouts.values()) or faults.stragglers:
        raise Bad("async.enabled", True, "faults.dropouts and faults.stragglers act on a round's batch of messages "
                   "in wall time; on the virtual clock use async.stragglers and async.straggler_factor")
    if scenario.evaluation.federated:
        raise Bad("async.enabled", True, "evaluation.federated = true: steps are scored on the server's held-out "
                   "set only (no round of clients to ask); set evaluation.federated = false")


#: Clients a round a 16-bit secure-aggregation ring can sum: each needs at least one grid step, (2^15 - 1) // n >= 2.
RING16_MAX_CLIENTS = 16_383

#: The distributed discrete Gaussian (privacy.dp.discrete): clients a round below this fit a 64-bit
#: ring with the noise's headroom; secagg.clip_range >= this x z x C keeps the noise below 2^46 steps.
DISCRETE_MAX_CLIENTS = 2048
DISCRETE_CLIP_RANGE_FACTOR = 128.0


def _check_discrete(scenario: Scenario) -> None:
    """Refuse what the distributed discrete Gaussian cannot run on: it lives on the secure-aggregation grid."""
    dp = scenario.dp
    if dp.placement != "distributed":
        raise Bad("dp.mechanism", dp.mechanism, "is noise the clients add on the secure-aggregation grid: "
                   "it needs dp.placement = \"distributed\" (and [secagg] enabled = true)")
    if scenario.secagg.bits != 64:
        raise Bad("secagg.bits", scenario.secagg.bits, "dp.mechanism = \"discrete_gaussian\" needs bits = 64: "
                   "a 32-bit ring leaves too few grid steps under the noise and no headroom for its sum")
    if dp.adaptive_clipping:
        raise Bad("dp.adaptive_clipping", True, "is not supported with dp.mechanism = \"discrete_gaussian\" "
                   "(its count bit is noised in floats); use a fixed clip_norm")
    if dp.noise_multiplier == 0:
        raise Bad("dp.noise_multiplier", 0, "dp.mechanism = \"discrete_gaussian\" needs noise (z > 0)")
    n = scenario.federation.per_round
    if n >= DISCRETE_MAX_CLIENTS:
        raise Bad("federation.per_round", n, f"dp.mechanism = \"discrete_gaussian\" sums at most "
                   f"{DISCRETE_MAX_CLIENTS - 1} clients a round in a 64-bit ring with room for the noise")
    # A client's share is sigma = z (C scale + sqrt(d)) / sqrt(K) grid steps, scale <= 2^52 / clip_range
    # (privacy.secagg.quantize); the sampler is exact only up to 2^46 steps, so even K = 1 must stay below.
    # (A z derived from target_epsilon is known only at run time: the clients refuse such a grid then.)
    z = dp.noise_multiplier
    need = DISCRETE_CLIP_RANGE_FACTOR * (z or 0.0) * dp.clip_norm
    if z is not None and scenario.secagg.clip_range < need:
        raise Bad("secagg.clip_range", scenario.secagg.clip_range,
                   f"dp.mechanism = \"discrete_gaussian\" with noise_multiplier {z:g} and clip_norm "
                   f"{dp.clip_norm:g} needs clip_range >= {need:g}: a finer grid makes the noise more than 2^46 "
                   "steps, which the sampler cannot draw exactly")


#: The tasks whose data ``[data] standardize = "federated"`` applies to (feature arrays ``x``).
STANDARDIZED_TASKS = ("learning.tasks.classification", "learning.tasks.regression")


def _check_standardize(scenario: Scenario) -> None:
    """Refuse what the federated statistics pass does not combine with, naming both keys."""
    if scenario.dp.enabled:
        raise Bad("data.standardize", "federated", "[dp] enabled = true: the statistics pass releases the "
                   "features' sums without DP noise, outside the privacy budget; standardise the files on the "
                   "devices, or turn one off")
    if scenario.asynchronous.enabled:
        raise Bad("data.standardize", "federated", "[async] enabled = true: the statistics pass is a "
                   "synchronous round; standardise the data beforehand, or turn one off")
    if scenario.task.entry and scenario.task.entry.split(":")[0] not in STANDARDIZED_TASKS:
        raise Bad("data.standardize", "federated", f"task.entry = {scenario.task.entry!r}: the pass standardises "
                   "the built-in classification and regression tasks' feature arrays; another task scales its own")


def _check_iid_attackers(scenario: Scenario) -> None:
    """``faults.byzantine.data = "iid"`` re-splits the built-in task's pooled data; refuse, by key, what has none."""
    data, entry = scenario.data, scenario.task.entry
    culprit = (("task.entry", entry) if entry and entry.split(":")[0] != "learning.tasks.classification" else
               ("data.dataset", "synthetic") if data.dataset == "synthetic" else
               ("data.partition", "resample") if data.partition == "resample" else
               ("data.path", "") if data.dataset == "file" and not data.path else None)
    if culprit is not None:
        key, value = culprit
        raise Bad("faults.byzantine.data", "iid", f"{key} = {value!r}: IID attackers copy samples of a pool that "
                   "the honest clients split, and only the built-in classification task on mnist, digits or a "
                   "data.path file has one; use data = \"own\"")
    spec, clients = scenario.faults.byzantine_spec, scenario.federation.clients
    if clients - len(spec.attackers(clients, scenario.seed)) < 1:
        raise Bad("faults.byzantine.fraction", spec.fraction,
                   f"of {clients} clients leaves no honest client to hold the data (faults.byzantine.data = \"iid\")")


def _check_robust(scenario: Scenario) -> None:
    """Refuse what a robust aggregator cannot be combined with, naming both keys."""
    name = scenario.strategy.name
    if scenario.secagg.enabled:
        raise Bad("strategy.name", name, "a robust aggregator must see every client's update, and "
                   "[secagg] enabled = true shows the server only their sum; choose one")
    if scenario.dp.enabled and name != "centered_clipping":
        raise Bad("strategy.name", name, "[dp] enabled = true needs each client's influence on the release "
                   "bounded, and a rule that ranks or selects updates (median, trimmed mean, Krum) has no such "
                   "bound for the DP noise to cover; use name = \"centered_clipping\" (which composes with "
                   "central DP) or turn one off")
    settings = scenario.strategy.settings
    if scenario.dp.enabled and isinstance(settings, CenteredClippingSettings) and settings.bucket_size != 1:
        raise Bad("strategy.centered_clipping.bucket_size", settings.bucket_size,
                   "[dp] enabled = true needs bucket_size = 1: a bucket of consecutive arrivals lets one "
                   "client's presence shift every later bucket, which the DP noise does not cover")
    if isinstance(settings, KrumSettings):
        f, n = settings.num_byzantine, scenario.federation.per_round
        if n <= 2 * f + 2:
            raise Bad("strategy.krum.num_byzantine", f, f"Krum needs more than 2 f + 2 clients per round, got {n}")
        if settings.num_selected > n - f:
            raise Bad("strategy.krum.num_selected", settings.num_selected,
                       f"exceeds clients per round minus num_byzantine ({n - f})")


#: The largest scenario file read: the shipped ones are a few KiB; ``/dev/zero`` never ends.
MAX_SCENARIO_BYTES = 2**20


def load_scenario(path: str | Path) -> Scenario:
    """Parse and validate a scenario file of at most :data:`MAX_SCENARIO_BYTES`.

    Raises
    ------
    ScenarioError
        One line naming the file, the key and the value; or the file and the
        cap, for a file larger than it (counted while reading: a device or a
        pipe has no size to trust).
    """
    path = Path(path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_SCENARIO_BYTES + 1)
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read scenario file ({exc.strerror or exc})") from None
    if len(raw) > MAX_SCENARIO_BYTES:
        raise ScenarioError(f"{path}: larger than {MAX_SCENARIO_BYTES // 2**20} MiB, the most a scenario file "
                            "may hold")
    try:
        text = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # as read_text's newlines
    except UnicodeDecodeError as exc:
        raise ScenarioError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    return loads_scenario(text, source=str(path))


def loads_scenario(text: str, source: str = "<string>") -> Scenario:
    """Parse and validate scenario TOML text; ``source`` names it in errors."""
    try:
        raw = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:  # ValueError: an int of >4300 digits
        raise ScenarioError(f"{source}: not valid TOML: {exc}") from None
    return scenario_from_dict(raw, source=source)


def scenario_from_dict(raw: Mapping[str, Any], source: str = "<dict>") -> Scenario:
    """Build a validated :class:`Scenario` from plain data (e.g. parsed TOML)."""
    if "name" not in raw:
        raw = {"name": Path(source).stem, **raw}
    try:
        scenario = build(Scenario, raw, prefix="")
    except Bad as bad:
        raise ScenarioError(f"{source}: {show_key(bad.key)} = {show(bad.value)}: {bad.why}") from None
    return _locate_task(scenario, source)


def _locate_task(scenario: Scenario, source: str) -> Scenario:
    """Pin ``[task] path`` to an absolute folder (the scenario file's, by default) and remember the file."""
    task = scenario.task
    if not task.entry or task.source:
        return scenario
    file = Path(source)
    base = file.resolve().parent if file.is_file() else Path.cwd()
    path = str((base / task.path).resolve())  # an absolute task.path stays as it is
    return dataclasses.replace(scenario, task=dataclasses.replace(task, path=path, source=source))


def build_options(cls: type, options: Mapping[str, Any], source: str, check: bool = True) -> Any:
    """Validate a task's ``[task]`` keys against the frozen dataclass ``cls`` the task declares.

    Types are checked as for every section (``Literal`` choices, numbers,
    booleans, strings, tables) and ``cls._check`` runs when defined (and
    ``check`` is on: an export's model is rebuilt without it), raising
    through :func:`bad_value`.

    Raises
    ------
    ScenarioError
        One line naming ``source``, the key (``task.<key>``) and the value.
    """
    try:
        return build(cls, options, prefix="task.", check=check)
    except Bad as bad:
        raise ScenarioError(f"{source}: {show_key(bad.key)} = {show(bad.value)}: {bad.why}") from None


def bad_value(key: str, value: Any, why: str) -> Exception:
    """Return the error a section's (or a task config's) ``_check`` raises for a bad value of ``key``."""
    return Bad(key, value, why)
