"""The scenario schema: frozen, validated dataclasses parsed once from TOML.

A scenario file describes a whole experiment: the data set and how it is split
over clients, the model, the federation, local training, the strategy, privacy
and the faults to inject. Every section is a frozen dataclass; parsing checks
every key and value and fails with one line naming the file, the key and the
value. Nothing is executed and nothing is mutated after parsing.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from scenarios.compression import CompressionSpec, check_compression
from scenarios.errors import ScenarioError
from scenarios.parse import Bad, at_least, at_most, build, fraction, non_negative, positive, show, show_key

__all__ = [
    "DataSpec", "ModelSpec", "FederationSpec", "TrainingSpec", "StrategySpec",
    "EvaluationSpec", "FaultSpec", "ByzantineSpec", "SecAggSpec", "DPSpec", "TaskSpec", "CompressionSpec", "Scenario",
    "load_scenario", "loads_scenario", "scenario_from_dict", "build_options", "bad_value", "FAULT_STAGES",
]

# Bounds that keep every count well inside a 64-bit store column and a sane run.
MAX_ROUNDS = 1_000_000
MAX_CLIENTS = 1_000_000
FAULT_STAGES = ("train", "advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask")
ROBUST_STRATEGIES = ("centered_clipping", "median", "trimmed_mean", "krum")
#: Byzantine behaviours: corrupt replies the aggregator must reject, then attacks
#: with valid-looking updates that robust aggregation must survive (runtimes.attacks).
CORRUPTIONS = ("nan", "wrong_shape", "oversized", "garbage")
ATTACKS = ("alie", "ipm", "signflip", "labelflip", "scaling", "mimic", "weight_inflation", "absent")


@dataclass(frozen=True)
class DataSpec:
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
        positive("alpha", self.alpha)
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
        non_negative("synthetic_alpha", self.synthetic_alpha)
        non_negative("synthetic_beta", self.synthetic_beta)
        non_negative("features", self.features)
        at_most("features", self.features, 10_000_000)
        non_negative("classes", self.classes)
        at_most("classes", self.classes, 100_000)
        if self.dataset == "file" and not self.path and not (self.features and self.classes > 1):
            raise Bad("path", self.path, "is required when dataset = 'file', unless data.features and data.classes "
                      "(at least 2) describe the devices' own files: then the aggregator needs no data")


@dataclass(frozen=True)
class ModelSpec:
    name: Literal["logreg", "mlp", "cnn"] = "cnn"


@dataclass(frozen=True)
class FederationSpec:
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

    def _check(self) -> None:
        positive("clients", self.clients)
        at_most("clients", self.clients, MAX_CLIENTS)
        fraction("fraction", self.fraction)
        non_negative("clients_per_round", self.clients_per_round)
        if self.clients_per_round > self.clients:
            raise Bad("clients_per_round", self.clients_per_round, f"exceeds clients = {self.clients}")
        positive("min_clients", self.min_clients)
        positive("deadline_s", self.deadline_s)
        at_most("deadline_s", self.deadline_s, 7 * 86_400.0)
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


@dataclass(frozen=True)
class TrainingSpec:
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0

    def _check(self) -> None:
        positive("local_epochs", self.local_epochs)
        at_most("local_epochs", self.local_epochs, 10_000)
        positive("batch_size", self.batch_size)
        at_most("batch_size", self.batch_size, 1_000_000)
        positive("lr", self.lr)
        at_most("lr", self.lr, 100.0)
        fraction("momentum", self.momentum, allow_zero=True, allow_one=False)


@dataclass(frozen=True)
class StrategySpec:
    name: Literal["fedavg", "fedavgm", "fedadam", "fedyogi", "fedprox",
                  "centered_clipping", "median", "trimmed_mean", "krum"] = "fedavg"
    server_lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    mu: float = 0.01
    # Robust aggregation (aggregator/strategies): centered clipping's radius and bucket
    # size, the trimmed mean's cut per end, Krum's assumed Byzantine count and Multi-Krum's m.
    clip_radius: float = 1.0
    bucket_size: int = 2
    trim_fraction: float = 0.2
    num_byzantine: int = 0
    num_selected: int = 1

    def _check(self) -> None:
        positive("server_lr", self.server_lr)
        fraction("momentum", self.momentum, allow_zero=True, allow_one=False)
        fraction("beta1", self.beta1, allow_zero=True, allow_one=False)
        fraction("beta2", self.beta2, allow_zero=True, allow_one=False)
        positive("tau", self.tau)
        non_negative("mu", self.mu)
        positive("clip_radius", self.clip_radius)
        positive("bucket_size", self.bucket_size)
        fraction("trim_fraction", self.trim_fraction, allow_zero=True, allow_one=False)
        if not self.trim_fraction < 0.5:
            raise Bad("trim_fraction", self.trim_fraction, "must be < 0.5 (a cut at each end)")
        non_negative("num_byzantine", self.num_byzantine)
        positive("num_selected", self.num_selected)

    @property
    def robust(self) -> bool:
        """Whether the rule needs to see every client's update (no secure aggregation)."""
        return self.name in ROBUST_STRATEGIES


@dataclass(frozen=True)
class EvaluationSpec:
    federated: bool = True
    server: bool = True
    every: int = 1
    clients: Literal["sampled", "all"] = "sampled"

    def _check(self) -> None:
        positive("every", self.every)
        at_most("every", self.every, MAX_ROUNDS)


@dataclass(frozen=True)
class ByzantineSpec:
    """``[faults] byzantine = { fraction = 0.2, attack = "alie" }``: who attacks, and how.

    ``scale`` multiplies the update for ``scaling``; ``epsilon`` is IPM's
    (Xie et al., UAI 2020) factor on the honest mean; ``z`` is ALIE's (Baruch
    et al., NeurIPS 2019) shift in standard deviations, derived from the
    number of clients and attackers when not given; ``inflated_examples`` is
    the example count ``weight_inflation`` reports.
    """

    fraction: float = 0.0
    attack: Literal["nan", "wrong_shape", "oversized", "garbage",
                    "alie", "ipm", "signflip", "labelflip", "scaling", "mimic", "weight_inflation",
                    "absent"] = "nan"
    scale: float = 10.0
    epsilon: float = 0.5
    z: float | None = None
    inflated_examples: int = 10**9  # core.messages.MAX_EXAMPLES: the most a reply may claim

    def _check(self) -> None:
        fraction("fraction", self.fraction, allow_zero=True, allow_one=False)
        positive("scale", self.scale)
        positive("epsilon", self.epsilon)
        if self.z is not None:
            positive("z", self.z)
        positive("inflated_examples", self.inflated_examples)


@dataclass(frozen=True)
class FaultSpec:
    dropouts: Mapping[str, float] = field(default_factory=dict)
    stragglers: float = 0.0
    straggler_delay_s: float = 0.0
    # A fraction (with the legacy byzantine_kind), or a ByzantineSpec table.
    byzantine: float | ByzantineSpec = 0.0
    byzantine_kind: Literal["nan", "wrong_shape", "oversized", "garbage"] = "nan"

    @property
    def byzantine_spec(self) -> ByzantineSpec:
        """The Byzantine clients, whichever way the file wrote them."""
        if isinstance(self.byzantine, ByzantineSpec):
            return self.byzantine
        return ByzantineSpec(fraction=self.byzantine, attack=self.byzantine_kind)

    def _check(self) -> None:
        for stage, frac in self.dropouts.items():
            if stage not in FAULT_STAGES:
                raise Bad(f"dropouts.{stage}", frac, f"unknown stage; expected one of {', '.join(FAULT_STAGES)}")
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
                raise Bad(f"dropouts.{stage}", frac, "must be a fraction in [0, 1)")
        fraction("stragglers", self.stragglers, allow_zero=True, allow_one=False)
        non_negative("straggler_delay_s", self.straggler_delay_s)
        if not isinstance(self.byzantine, ByzantineSpec):
            fraction("byzantine", self.byzantine, allow_zero=True, allow_one=False)
        elif self.byzantine_kind != "nan":
            raise Bad("byzantine_kind", self.byzantine_kind, "give the attack inside the byzantine table instead")


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
        positive("concurrency", self.concurrency)
        positive("buffer_size", self.buffer_size)
        non_negative("max_staleness", self.max_staleness)
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


@dataclass(frozen=True)
class SecAggSpec:
    enabled: bool = False
    threshold: float = 0.0          # 0: strict majority of each neighbourhood; < 1: a fraction; else t
    graph: Literal["complete", "kregular"] = "complete"
    degree: int = 0
    clip_range: float = 8.0
    bits: Literal[16, 32, 64] = 32  # the masked ring: 16 halves the bytes, and sums at most 16,383 clients
    max_weight: float = 10000.0
    stage_timeout_s: float = 30.0
    client_metrics: bool = True     # false: no per-client examples / loss in clear, the sum only
    threat_model: Literal["malicious", "semi-honest"] = "malicious"  # see docs/secagg.md

    def _check(self) -> None:
        non_negative("threshold", self.threshold)
        if 0 < self.threshold <= 0.5 and self.threat_model != "semi-honest":
            raise Bad("threshold", self.threshold, "a fraction <= 0.5 is no strict majority of a "
                       "neighbourhood; a lower threshold needs threat_model = \"semi-honest\"")
        non_negative("degree", self.degree)
        positive("clip_range", self.clip_range)
        positive("max_weight", self.max_weight)
        positive("stage_timeout_s", self.stage_timeout_s)


@dataclass(frozen=True)
class DPSpec:
    enabled: bool = False
    placement: Literal["central", "distributed"] = "central"
    clip_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    sampling: Literal["poisson", "fixed"] = "poisson"
    adaptive_clipping: bool = False
    target_quantile: float = 0.5
    clip_lr: float = 0.2
    count_noise_multiplier: float | None = None
    local_dp_sgd: bool = False
    local_noise_multiplier: float = 1.0
    local_max_grad_norm: float = 1.0
    # The noise the clients add in the distributed placement: continuous Gaussian (float, before
    # quantisation), or the distributed discrete Gaussian on the secure-aggregation grid.
    mechanism: Literal["gaussian", "discrete_gaussian"] = "gaussian"

    def _check(self) -> None:
        positive("clip_norm", self.clip_norm)
        if self.noise_multiplier is not None:
            non_negative("noise_multiplier", self.noise_multiplier)
        if self.target_epsilon is not None:
            positive("target_epsilon", self.target_epsilon)
        fraction("delta", self.delta, allow_one=False)
        fraction("target_quantile", self.target_quantile, allow_one=False)
        positive("clip_lr", self.clip_lr)
        if self.enabled and self.noise_multiplier is None and self.target_epsilon is None:
            raise Bad("noise_multiplier", None, "give noise_multiplier, or target_epsilon to derive it")


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
        spec = build(cls, own, key + ".")
        return dataclasses.replace(spec, options={**options, **{k: v for k, v in raw.items() if k not in TASK_KEYS}})

    def _check(self) -> None:
        if self.entry and not _is_entry(self.entry):
            raise Bad("entry", self.entry, "must be \"package.module:Class\" (a module path, a colon, a name)")
        if self.path and not self.entry:
            raise Bad("path", self.path, "needs an entry to import")


def _is_entry(entry: str) -> bool:
    module, sep, name = entry.partition(":")
    return bool(sep) and name.isidentifier() and all(part.isidentifier() for part in module.split("."))


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
        if self.data.standardize == "federated":
            _check_standardize(self)
        attack = self.faults.byzantine_spec
        if attack.fraction > 0 and attack.attack in ATTACKS and self.secagg.enabled:
            raise Bad("faults.byzantine.attack", attack.attack, "the attack harness forges plain train replies, "
                       "and [secagg] enabled = true masks them in protocol stages it does not drive; choose one")

    def with_overrides(self, **changes: Any) -> Scenario:
        """Return a copy with top-level values replaced (e.g. rounds, seed), re-validated."""
        return scenario_from_dict({**self.to_dict(), **changes}, source="<override>")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {self.TOML_KEYS.get(k, k): v for k, v in out.items()}


def _check_async(scenario: Scenario) -> None:
    """What the buffered asynchronous mode does not combine with (yet), each naming both keys."""
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
                   "fedavgm, fedadam or fedyogi")
    attack = scenario.faults.byzantine_spec
    if attack.fraction > 0 and attack.attack in ATTACKS:
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
    """The distributed discrete Gaussian lives on the secure-aggregation grid: refuse what it cannot run on."""
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
    """What the federated statistics pass does not combine with, naming both keys."""
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
    if scenario.dp.enabled and scenario.strategy.bucket_size != 1:
        raise Bad("strategy.bucket_size", scenario.strategy.bucket_size,
                   "[dp] enabled = true needs bucket_size = 1: a bucket of consecutive arrivals lets one "
                   "client's presence shift every later bucket, which the DP noise does not cover")
    if name == "krum":
        f, n = scenario.strategy.num_byzantine, scenario.federation.per_round
        if n <= 2 * f + 2:
            raise Bad("strategy.num_byzantine", f, f"Krum needs more than 2 f + 2 clients per round, got {n}")
        if scenario.strategy.num_selected > n - f:
            raise Bad("strategy.num_selected", scenario.strategy.num_selected,
                       f"exceeds clients per round minus num_byzantine ({n - f})")


def load_scenario(path: str | Path) -> Scenario:
    """Parse and validate a scenario file.

    Raises
    ------
    ScenarioError
        One line naming the file, the key and the value.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read scenario file ({exc.strerror})") from None
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


def build_options(cls: type, options: Mapping[str, Any], source: str) -> Any:
    """Validate a task's ``[task]`` keys against the frozen dataclass ``cls`` the task declares.

    Types are checked as for every section (``Literal`` choices, numbers,
    booleans, strings, tables) and ``cls._check`` runs when defined, raising
    through :func:`bad_value`.

    Raises
    ------
    ScenarioError
        One line naming ``source``, the key (``task.<key>``) and the value.
    """
    try:
        return build(cls, options, prefix="task.")
    except Bad as bad:
        raise ScenarioError(f"{source}: {show_key(bad.key)} = {show(bad.value)}: {bad.why}") from None


def bad_value(key: str, value: Any, why: str) -> Exception:
    """The error a section's (or a task config's) ``_check`` raises for a bad value of ``key``."""
    return Bad(key, value, why)
