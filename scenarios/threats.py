"""The sections that attack a scenario's run and the ones that protect it.

``[faults]`` (dropouts per protocol stage, stragglers, Byzantine clients and
their attacks), ``[secagg]`` (secure aggregation) and ``[dp]`` (differential
privacy): one frozen dataclass each, whose ``_check`` validates the section's
own keys (the combinations across sections are refused by
:class:`scenarios.schema.Scenario`). Import them from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from scenarios.parse import Bad, fraction, non_negative, positive

__all__ = ["ByzantineSpec", "FaultSpec", "SecAggSpec", "DPSpec", "FAULT_STAGES", "CORRUPTIONS", "ATTACKS"]

FAULT_STAGES = ("train", "advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask")
#: Byzantine behaviours: corrupt replies the aggregator must reject, then attacks
#: with valid-looking updates that robust aggregation must survive (runtimes.attacks).
CORRUPTIONS = ("nan", "wrong_shape", "oversized", "garbage")
ATTACKS = ("alie", "ipm", "signflip", "labelflip", "scaling", "mimic", "weight_inflation", "absent")


@dataclass(frozen=True)
class ByzantineSpec:
    """``[faults] byzantine = { fraction = 0.2, attack = "alie" }``: who attacks, and how.

    ``scale`` multiplies the update for ``scaling``; ``epsilon`` is IPM's
    (Xie et al., UAI 2020) factor on the honest mean; ``z`` is ALIE's (Baruch
    et al., NeurIPS 2019) shift in standard deviations, derived from the
    number of clients and attackers when not given; ``inflated_examples`` is
    the example count ``weight_inflation`` reports.

    ``data`` says what the attackers hold. ``"own"``: each is one of the
    federation's partitions, so its data is lost to the model whatever the
    rule does, and under a skewed split an attack can erase a class the
    attackers hold most of. ``"iid"`` (Karimireddy, He & Jaggi's setup): the
    honest clients split the whole pool and each attacker holds an IID copy of
    an honest client's share, so an attack can corrupt the rule but remove no
    data (harness attacks on a partitioned data set only).
    """

    fraction: float = 0.0
    attack: Literal["nan", "wrong_shape", "oversized", "garbage",
                    "alie", "ipm", "signflip", "labelflip", "scaling", "mimic", "weight_inflation",
                    "absent"] = "nan"
    scale: float = 10.0
    epsilon: float = 0.5
    z: float | None = None
    inflated_examples: int = 10**9  # core.replies.MAX_EXAMPLES: the most a reply may claim
    data: Literal["own", "iid"] = "own"

    @property
    def active(self) -> bool:
        """Whether a fraction of the clients runs one of the harness's attacks (not a transport corruption)."""
        return self.attack in ATTACKS and self.fraction > 0

    def attackers(self, num_clients: int, seed: int) -> tuple[int, ...]:
        """Return the attacking partition ids, sorted: ``round(fraction * num_clients)``, fixed by the seed."""
        if not self.active:
            return ()
        count = int(round(self.fraction * num_clients))
        order = np.random.default_rng([seed, 0xB12]).permutation(num_clients)
        return tuple(sorted(int(p) for p in order[:count]))

    def iid_copies(self, num_clients: int, seed: int) -> tuple[int, ...]:
        """Return the partitions that hold IID copies instead of a share of the pool (``data = "iid"``)."""
        return self.attackers(num_clients, seed) if self.data == "iid" else ()

    def _check(self) -> None:
        fraction("fraction", self.fraction, allow_zero=True, allow_one=False)
        positive("scale", self.scale)
        positive("epsilon", self.epsilon)
        if self.z is not None:
            positive("z", self.z)
        positive("inflated_examples", self.inflated_examples)
        if self.data == "iid" and self.attack not in ATTACKS:
            raise Bad("data", self.data, f"IID attacker data is for the attack harness ({', '.join(ATTACKS)}); "
                       f"{self.attack!r} corrupts the transport, not the data")


@dataclass(frozen=True)
class FaultSpec:
    """``[faults]``: injected dropouts per stage, stragglers, and Byzantine clients."""

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
class SecAggSpec:
    """``[secagg]``: secure aggregation, its threshold, neighbourhood graph, quantisation and threat model."""

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
    """``[dp]``: client-level differential privacy: clipping, noise, its placement and the accounting."""

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
