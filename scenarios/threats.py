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

from scenarios.bounds import MAX_CLIENTS, MAX_WAIT_S
from scenarios.parse import Bad, fraction, within

__all__ = ["ByzantineSpec", "FaultSpec", "SecAggSpec", "DPSpec", "FAULT_STAGES", "CORRUPTIONS", "ATTACKS",
           "MAX_NOISE", "MIN_NOISE", "MAX_NORM"]

FAULT_STAGES = ("train", "advertise_keys", "share_keys", "masked_input", "consistency_check", "unmask")
#: Byzantine behaviours: corrupt replies the aggregator must reject, then attacks
#: with valid-looking updates that robust aggregation must survive (runtimes.attacks).
CORRUPTIONS = ("nan", "wrong_shape", "oversized", "garbage")
ATTACKS = ("alie", "ipm", "signflip", "labelflip", "scaling", "mimic", "weight_inflation", "absent")
#: The smallest and largest noise multiplier (noise std / clip norm) besides 0: below 1e-3 a round spends an
#: epsilon above 1e5, which protects nothing; above 1e3 the noise is a million times the signal.
MIN_NOISE, MAX_NOISE = 1e-3, 1e3
#: The largest L2 norm (a clip norm, a clipping range), far above any update's.
MAX_NORM = 1e6
#: How far an attack may scale an update: as far as the largest ``[federation] max_update_ratio`` lets through.
_MAX_ATTACK_FACTOR = 1e6


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
        within("scale", self.scale, 0, _MAX_ATTACK_FACTOR, low_open=True)
        within("epsilon", self.epsilon, 0, _MAX_ATTACK_FACTOR, low_open=True)
        if self.z is not None:  # standard deviations of the honest updates
            within("z", self.z, 0, 100, low_open=True)
        within("inflated_examples", self.inflated_examples, 1, 10**9)  # core.replies.MAX_EXAMPLES
        if self.data == "iid" and self.attack not in ATTACKS:
            raise Bad("data", self.data, f"IID attacker data is for the attack harness ({', '.join(ATTACKS)}); "
                       f"{self.attack!r} corrupts the transport, not the data")


@dataclass(frozen=True)
class FaultSpec:
    """``[faults]``: injected dropouts per stage, stragglers, Byzantine clients, and edge aggregators that vanish."""

    dropouts: Mapping[str, float] = field(default_factory=dict)
    stragglers: float = 0.0
    straggler_delay_s: float = 0.0
    # Under [hierarchy]: the fraction of a round's edges that vanish after their devices trained (never answer)
    edges: float = 0.0
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
            fraction(f"dropouts.{stage}", frac, allow_zero=True, allow_one=False)
        fraction("stragglers", self.stragglers, allow_zero=True, allow_one=False)
        fraction("edges", self.edges, allow_zero=True, allow_one=False)
        within("straggler_delay_s", self.straggler_delay_s, 0, MAX_WAIT_S)
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
        _check_threshold(self.threshold)
        if 0 < self.threshold <= 0.5 and self.threat_model != "semi-honest":
            raise Bad("threshold", self.threshold, "a fraction <= 0.5 is no strict majority of a "
                       "neighbourhood; a lower threshold needs threat_model = \"semi-honest\"")
        within("degree", self.degree, 2, MAX_CLIENTS, or_zero=True)  # 0: ceil(3 log2 n)
        # every coordinate is clipped to +-clip_range, then scaled by (ring bound) / clip_range: below 1e-6 the
        # updates are clipped away, and far below it the scale is no float
        within("clip_range", self.clip_range, 1e-6, MAX_NORM)
        within("max_weight", self.max_weight, 0, 10**9, low_open=True)  # an example count: core.replies.MAX_EXAMPLES
        within("stage_timeout_s", self.stage_timeout_s, 0, MAX_WAIT_S, low_open=True)


def _check_threshold(threshold: float) -> None:
    """Refuse a threshold that is neither 0 (a strict majority), a fraction below 1, nor a count of clients."""
    if not (0 <= threshold < 1 or (float(threshold).is_integer() and 2 <= threshold <= MAX_CLIENTS)):
        raise Bad("threshold", threshold, f"must be 0 (a strict majority), a fraction in (0, 1) or a whole number "
                  f"of clients in [2, {MAX_CLIENTS:,}]")


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
        within("clip_norm", self.clip_norm, 0, MAX_NORM, low_open=True)
        if self.noise_multiplier is not None:
            within("noise_multiplier", self.noise_multiplier, MIN_NOISE, MAX_NOISE, or_zero=True)
        if self.target_epsilon is not None:  # past 1,000 a guarantee bounds nothing
            within("target_epsilon", self.target_epsilon, 0, 1000, low_open=True)
        fraction("delta", self.delta, allow_one=False)
        fraction("target_quantile", self.target_quantile, allow_one=False)
        within("clip_lr", self.clip_lr, 0, 10, low_open=True)  # C moves by up to exp(clip_lr) a round
        self._check_count_noise()
        within("local_noise_multiplier", self.local_noise_multiplier, MIN_NOISE, MAX_NOISE, or_zero=True)
        within("local_max_grad_norm", self.local_max_grad_norm, 0, MAX_NORM, low_open=True)
        if self.enabled and self.noise_multiplier is None and self.target_epsilon is None:
            raise Bad("noise_multiplier", None, "give noise_multiplier, or target_epsilon to derive it")

    def _check_count_noise(self) -> None:
        """``sigma_b``: a std of a count of clients, above ``z / 2`` (Andrew et al. 2021, Theorem 1)."""
        sigma_b, z = self.count_noise_multiplier, self.noise_multiplier
        if sigma_b is None:
            return
        within("count_noise_multiplier", sigma_b, MIN_NOISE, MAX_CLIENTS)
        if self.adaptive_clipping and z is not None and not sigma_b > z / 2:
            raise Bad("count_noise_multiplier", sigma_b, f"must exceed noise_multiplier / 2 = {z / 2:g} (the "
                      "count alone would spend the whole budget; Andrew et al. 2021, Theorem 1)")
