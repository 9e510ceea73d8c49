"""DP-FedAvg: a strategy wrapper that clips, noises and accounts every round.

McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent
Language Models", ICLR 2018 (Algorithm 1, the fixed-denominator estimator
``f_f``), with adaptive clipping from Andrew et al., NeurIPS 2021. The wrapper
composes with any inner strategy: the inner strategy's server optimiser sees
only the privatised mean, so everything it does is post-processing.

A round, as the round loop drives it::

    dp = strategy.for_round(state)          # binds this round's clip norm
    nodes = dp.sample(node_ids, m)          # secure Poisson (or fixed-size) sample
    dp = dp.with_cohort(len(nodes))         # noise shares follow the realised sample
    config = dp.configure_train(config)     # the DP settings for the clients
    agg = dp.new_aggregate(size)            # model size (+1 with adaptive clipping)
    agg = dp.accumulate(agg, update, n)     # per reply (central: clips here); or dp.fold_sum(agg, secure_sum)
    mean = dp.finalize(agg, dp.noise_rng()) # noise, fixed denominator; + 1 value: the contributors
    state = dp.apply(state, mean)           # inner apply, clip update, accountants (release and server view)

The loops reach the hooks beside the six methods of every strategy (the
sample, the noise generator, the cohort, the secure sum's bound, the
accountant) through the functions of :mod:`core.strategy`, which give any
other strategy a plain round's behaviour: these hooks are DP's own.

Placements
----------
``central``
    The trusted aggregator clips every update (again: clipping is
    idempotent, so a client that already clipped loses nothing) and adds
    ``N(0, (z C)^2)`` to the sum.
``distributed`` (only with secure aggregation: the scenario refuses it otherwise)
    Each of the ``K`` clients actually sampled this round clips and adds
    ``N(0, (z C)^2 / K)`` itself; secure aggregation sums the shares to the
    full noise. The server must not clip again: it sees no single update
    under secure aggregation, and re-clipping a noised vector would destroy
    its signal. When only ``c < K`` clients contribute (dropouts), the server
    tops the noise up by ``(1 - c / K) (z C)^2``, so the released model always
    carries exactly ``(z C)^2`` whatever ``K`` and ``c`` came out as, and
    releases nothing about them. What the server itself saw had only
    ``(c / K) (z C)^2``: that is what :meth:`DPFedAvg.server_view_epsilon`
    accounts, round by round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Self

import numpy as np

from core import aggregate
from core.instructions import COHORT, TrainConfig
from core.strategy import PrivateStrategy, ServerState, Strategy, describe
from privacy.dp import adaptive as adapt
from privacy.dp.accountant import RoundEvent, Sampling, epsilon_of
from privacy.dp.bounding import CentredTerms, bounded_sum, fold_private_term
from privacy.dp.errors import DPConfigError, DPStateError
from privacy.dp.mechanisms import ClientDPConfig, Placement
from privacy.dp.noise import NoiseMechanism, mechanism_named
from privacy.dp.rng import secure_rng
from privacy.dp.sampling import sample_clients
from privacy.dp.state import STATE_KEY, DPState

__all__ = ["DPFedAvg"]


@dataclass(frozen=True)
class DPFedAvg(PrivateStrategy[aggregate.MeanState]):
    """Client-level differentially private FedAvg around an inner strategy.

    Parameters
    ----------
    inner : Strategy
        Applies the privatised mean (its server optimiser); its own
        ``accumulate``/``finalize`` are replaced (updates get weight 1). A
        rule whose per-client term is centred elsewhere (centered clipping)
        hands DP that term through :class:`privacy.dp.bounding.CentredTerms`.
    clip_norm : float
        L2 bound ``C`` on each client's update (the initial one when adaptive).
    noise_multiplier : float
        ``z``: noise std on the sum over ``C``; with adaptive clipping the
        effective multiplier of update and count together.
    expected_clients : int
        ``m``, clients per round: the fixed denominator of the mean.
    population : int
        ``N``, clients that can be sampled; ``q = m / N``.
    delta : float
        The delta at which epsilon is reported.
    sampling : {"poisson", "fixed"}
        How the round loop samples clients (see :mod:`privacy.dp.accountant`).
    placement : {"central", "distributed"}
        Who adds the noise (see the module docstring).
    adaptive : AdaptiveClipConfig | None
        Adaptive clipping settings, or ``None`` for a fixed clip norm.
    target_epsilon : float | None
        Budget; :meth:`would_exceed_budget` says when to stop.
    mechanism : {"gaussian", "discrete_gaussian"}
        Distributed placement: the clients' noise shares are continuous
        Gaussian (added in floats before quantisation), or the distributed
        discrete Gaussian added on the secure-aggregation grid
        (:mod:`privacy.dp.discrete`); the server's top-up for dropouts then
        comes from a cryptographic stream too.
    """

    inner: Strategy[Any]
    clip_norm: float
    noise_multiplier: float
    expected_clients: int
    population: int
    delta: float
    sampling: Sampling = "poisson"
    placement: Placement = "central"
    adaptive: adapt.AdaptiveClipConfig | None = None
    target_epsilon: float | None = None
    mechanism: str = "gaussian"
    bound_to_round: bool = False  # set by for_round(): the clip norm of one round is fixed
    cohort: int | None = None  # set by with_cohort(): clients sampled this round (K), else m
    name: str = "dp-fedavg"

    def __post_init__(self) -> None:
        """Refuse settings DP-FedAvg cannot account for, naming the scenario key (:class:`DPConfigError`)."""
        if not self.clip_norm > 0 or not math.isfinite(self.clip_norm):
            raise DPConfigError("clip_norm", self.clip_norm, "must be a positive number")
        if self.placement not in ("central", "distributed"):
            raise DPConfigError("placement", self.placement, "must be 'central' or 'distributed'")
        self.noise.check(placement=self.placement, adaptive=self.adaptive is not None,
                         noise_multiplier=self.noise_multiplier)
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise DPConfigError("target_epsilon", self.target_epsilon, "must be > 0")
        if not 0 < self.delta < 1:
            raise DPConfigError("delta", self.delta, "must be in (0, 1)")
        self._planned_event()  # validates sampling, m, N and z
        if self.adaptive is not None:  # validates sigma_b against z
            adapt.update_noise_multiplier(self.noise_multiplier, self.count_noise_std)

    # ------------------------------------------------------------ derived figures

    @property
    def noise(self) -> NoiseMechanism:
        """Return the noise mechanism ``mechanism`` names (:data:`privacy.dp.noise.MECHANISMS`)."""
        return mechanism_named(self.mechanism)

    @property
    def discrete(self) -> bool:
        """Whether the clients' shares are added on secure aggregation's grid (the distributed discrete Gaussian)."""
        return self.noise.on_grid

    @property
    def rate(self) -> float:
        """Sampling rate ``q = m / N``."""
        return self.expected_clients / self.population

    @property
    def count_noise_std(self) -> float:
        """``sigma_b``, the noise std on the centred count (0 without adaptive clipping)."""
        return self.adaptive.sigma_b(self.expected_clients) if self.adaptive else 0.0

    @property
    def update_noise_multiplier(self) -> float:
        """Noise multiplier of the update sum: ``z``, raised under adaptive clipping."""
        if self.adaptive is None:
            return self.noise_multiplier
        return adapt.update_noise_multiplier(self.noise_multiplier, self.count_noise_std)

    @property
    def tail(self) -> int:
        """Extra coordinates after the model in client payloads (the count bit)."""
        return 1 if self.adaptive else 0

    @property
    def sampled(self) -> int:
        """``K``, the clients sampled this round (``m`` until :meth:`with_cohort` binds it)."""
        return max(1, self.expected_clients if self.cohort is None else self.cohort)

    # ------------------------------------------------------------ per-round binding

    def for_round(self, state: ServerState) -> Self:
        """Return this strategy with the clip norm of ``state`` bound, for one round."""
        clip = self.dp_state(state).clip if self.adaptive is not None else self.clip_norm
        return replace(self, inner=self.inner.for_round(state), clip_norm=clip, bound_to_round=True)

    def with_cohort(self, sampled: int) -> Self:
        """Return this strategy told that ``sampled`` clients were drawn this round.

        Each client's noise share is then ``z C / sqrt(K)`` with ``K = sampled``,
        so the shares of a full cohort sum to exactly ``(z C)^2`` however large
        the Poisson sample came out: the released noise does not reveal ``K``.
        """
        if isinstance(sampled, bool) or not isinstance(sampled, int) or sampled < 0:
            raise DPConfigError("sampled", sampled, "must be an integer >= 0")
        return replace(self, cohort=sampled)

    def for_edge(self, config: TrainConfig) -> Self:
        """Return this strategy bound as the round's instruction ``config`` says: what a deployed edge folds with.

        An edge aggregator holds no DP state: the round's clip norm (``dp-clip``,
        the one its devices clip to) and cohort (``cohort``) come with the
        instruction, as the aggregator bound them (:meth:`for_round`, :meth:`with_cohort`).

        Raises
        ------
        DPConfigError
            The instruction carries no DP settings, or a cohort that is not a count.
        """
        told = ClientDPConfig.from_config(config)
        if told is None:
            raise DPConfigError("clip_norm", None, "the round's instruction carries no DP settings; an edge of a "
                                "DP run cannot clip without the round's clip norm")
        bound = replace(self, clip_norm=told.clip, bound_to_round=True)
        cohort = config.get(COHORT)
        return bound.with_cohort(cohort) if cohort is not None else bound

    def dp_state(self, state: ServerState) -> DPState:
        """Return the DP state carried in ``state`` (fresh before the first round).

        Raises
        ------
        DPStateError
            A state past round 0 without DP state: the spend is unknown.
        """
        data = state.wrapper_state.get(STATE_KEY)
        if data is None:
            if state.round > 0:
                raise DPStateError(f"state at round {state.round} carries no DP state; "
                                   "the privacy already spent is unknown")
            return DPState(clip=self.clip_norm)
        return DPState.from_json(data)

    def _require_bound(self) -> None:
        if self.adaptive is not None and not self.bound_to_round:
            raise DPStateError("adaptive clipping moves the clip norm every round: call "
                               "strategy.for_round(state) and use the result for the round")

    # ------------------------------------------------------------ Strategy interface

    def fresh_state(self, params: np.ndarray) -> ServerState:
        """Return the state before round 1 with a fresh DP state (the initial clip norm, nothing spent)."""
        return ServerState(params=params.astype(np.float32, copy=True),
                           wrapper_state={STATE_KEY: DPState(clip=self.clip_norm).to_json()})

    def configure_train(self, config: TrainConfig) -> TrainConfig:
        """Return the inner strategy's settings plus the DP settings of :class:`ClientDPConfig`.

        Central placement around a rule whose private term is centred elsewhere
        (centered clipping): no DP settings, since a client clipping its raw
        delta to ``C`` first would shrink honest updates towards 0 before the
        rule centres them; the server clips the rule's term, which is what the
        sensitivity needs.
        """
        inner = self.inner.configure_train(config)
        if self.placement == "central" and isinstance(self.inner, CentredTerms):
            self._require_bound()
            return inner
        return inner.with_settings(self.client_dp_config().to_settings())

    def client_dp_config(self) -> ClientDPConfig:
        """Return what each client must do this round (see :func:`privacy.dp.client_payload`)."""
        self._require_bound()
        if self.placement == "central":
            return ClientDPConfig(clip=self.clip_norm, adaptive=self.adaptive is not None)
        share = math.sqrt(self.sampled)
        return ClientDPConfig(clip=self.clip_norm, noise_std=self.update_noise_multiplier * self.clip_norm / share,
                              adaptive=self.adaptive is not None, count_noise_std=self.count_noise_std / share,
                              discrete=self.discrete)

    def sample(self, node_ids: Sequence[int], k: int) -> list[int]:
        """Draw the clients for one round from a secure generator.

        A sample anyone can predict from the scenario's seed would cancel the
        amplification.
        """
        return sample_clients(node_ids, k, self.population, self.sampling, secure_rng())

    def noise_rng(self) -> np.random.Generator:
        """Noise must not come from a seed someone knows: a secure generator."""
        return secure_rng()

    def new_aggregate(self, size: int) -> aggregate.MeanState:
        """Return an empty sum over ``size`` model values, plus the count coordinate when adaptive."""
        return aggregate.empty(size + self.tail)

    def accumulate(self, agg: aggregate.MeanState, update: np.ndarray, num_examples: float, *,  # noqa: ARG002
                   checked: bool = False) -> aggregate.MeanState:
        """Fold one client's payload with weight 1 (example counts would leak and break the bound).

        Central: the inner strategy's per-client term (the delta itself, or a
        robust rule's bounded term: :meth:`CentredTerms.private_term`) is clipped
        to ``C`` and the count bit clamped to [-1/2, 1/2], whatever the client
        sent. Distributed: the noised payload is summed as is.
        """
        self._require_bound()
        update = aggregate.check_update(update, agg.size, finite=not checked)
        if self.placement == "distributed":
            return aggregate.add(agg, update, 1.0, checked=True)
        term = self.inner.private_term if isinstance(self.inner, CentredTerms) else _delta
        return fold_private_term(agg, update, term, self.clip_norm, self.tail)

    def fold_sum(self, agg: aggregate.MeanState, partial: aggregate.MeanState) -> aggregate.MeanState:
        """Fold a securely summed partial aggregate.

        Under secure aggregation the server sees no single update, so it cannot
        clip: the clients clipped (and, distributed, noised) their own updates
        as :meth:`configure_train` told them. Each client weighs 1, so the sum's
        weight must equal its count; anything else is refused. The summed
        count bit is clamped into the range ``count`` honest clients can
        produce (:func:`privacy.dp.bounding.bounded_sum`), so clients who
        lie about their bit cannot push the clip norm beyond what the same
        number of honest clients could.
        """
        self._require_bound()
        count_share_std = self.client_dp_config().count_noise_std if self.tail else 0.0
        return aggregate.merge(agg, bounded_sum(partial, agg.size, self.tail, count_share_std))

    def finalize(self, agg: aggregate.MeanState, rng: np.random.Generator) -> np.ndarray:
        """Add the Gaussian noise and divide by the fixed denominator ``m``.

        Returns the mean update, followed (adaptive clipping) by the
        privatised fraction ``b_bar`` of clients under the clip norm, and
        last the number of contributors ``c`` (one value longer than the
        aggregate); :meth:`apply` consumes both.
        Distributed: the server adds what the missing ``K - c`` shares would
        have, so the released noise is ``(z C)^2`` for any ``K`` and ``c``.
        ``rng`` must be :func:`privacy.dp.secure_rng` outside tests: noise
        from a seed someone knows can be subtracted.
        """
        self._require_bound()
        share = 1.0 if self.placement == "central" else max(0.0, 1.0 - agg.count / self.sampled)
        size = agg.size - self.tail
        out = np.append(agg.total, np.float32(agg.count)).astype(np.float32, copy=False)
        std = self.update_noise_multiplier * self.clip_norm * math.sqrt(share)
        out[:size] += self.noise.server_noise(size, std, rng)
        out[:-1] /= np.float32(self.expected_clients)
        if self.adaptive is not None:
            count = float(agg.total[size]) + self.count_noise_std * math.sqrt(share) * float(rng.standard_normal())
            out[size] = min(1.0, max(0.0, adapt.below_fraction(count, self.expected_clients)))
        return out

    def apply(self, state: ServerState, mean_delta: np.ndarray) -> ServerState:
        """Apply the privatised mean with the inner strategy, then account the round."""
        self._require_bound()
        dp = self.dp_state(state)
        if self.adaptive is not None and dp.clip != self.clip_norm:
            raise DPStateError(f"bound clip norm {self.clip_norm} is not the state's {dp.clip}: "
                               "bind with for_round(state) on the state being advanced")
        size = state.params.size
        if mean_delta.shape != (size + self.tail + 1,):
            raise DPStateError(f"mean update has shape {mean_delta.shape}, expected ({size + self.tail + 1},): "
                               "pass finalize's result to apply unchanged")
        mean = mean_delta[:size]
        new = self.inner.apply(state, self.inner.from_private_mean(mean) if isinstance(self.inner, CentredTerms)
                               else mean)
        below, clip = None, self.clip_norm
        if self.adaptive is not None:
            below = float(mean_delta[size])
            clip = adapt.next_clip(dp.clip, below, self.adaptive)
        event = self._planned_event()
        eps = epsilon_of(dp.history + (event,), self.delta)
        record = dp.recorded(event, clip=clip, epsilon=eps, below_fraction=below,
                             server_event=self._server_event(int(round(float(mean_delta[-1])))))
        return replace(new, wrapper_state={**new.wrapper_state, STATE_KEY: record.to_json()})

    def settings(self) -> dict[str, Any]:
        """Return the settings worth recording with the run: the inner strategy's, and the DP ones."""
        return {"name": self.name, "inner": describe(self.inner), "clip_norm": self.clip_norm,
                "noise_multiplier": self.noise_multiplier,
                "update_noise_multiplier": self.update_noise_multiplier,
                "expected_clients": self.expected_clients, "population": self.population,
                "delta": self.delta, "sampling": self.sampling, "placement": self.placement,
                "mechanism": self.mechanism,
                "adaptive": None if self.adaptive is None else {
                    "target_quantile": self.adaptive.target_quantile,
                    "learning_rate": self.adaptive.learning_rate, "count_noise_std": self.count_noise_std},
                "target_epsilon": self.target_epsilon}

    # ------------------------------------------------------------ privacy spent

    def epsilon(self, state: ServerState) -> float:
        """Epsilon spent up to ``state`` at :attr:`delta`, against anyone who sees the models.

        Sampling amplification counts, which assumes the sample stays secret
        (see :func:`privacy.dp.sample_clients`).
        """
        return epsilon_of(self.dp_state(state).history, self.delta)

    def server_view_epsilon(self, state: ServerState) -> float:
        """Epsilon against the aggregator itself, which knows whom it sampled.

        Distributed placement: every round in which ``c`` clients contributed
        counts as an unsampled Gaussian mechanism (``q = 1``: the server knows
        the sample) with the noise those ``c`` shares carried, multiplier
        ``z sqrt(c / K)``; the server's own top-up does not hide anything from
        the server. Central placement: ``inf``, the server sees every update.
        """
        if self.placement == "central":
            return math.inf
        return epsilon_of(self.dp_state(state).server_history, self.delta)

    def round_metrics(self, state: ServerState) -> dict[str, float]:
        """Per-round figures for the run store: the server-view epsilon (distributed, when finite)."""
        eps = self.server_view_epsilon(state)
        return {"server-epsilon": eps} if math.isfinite(eps) else {}

    def would_exceed_budget(self, state: ServerState) -> bool:
        """Whether running one more round would take epsilon above ``target_epsilon``."""
        if self.target_epsilon is None:
            return False
        planned = self.dp_state(state).history + (self._planned_event(),)
        return epsilon_of(planned, self.delta) > self.target_epsilon

    def _planned_event(self) -> RoundEvent:
        return RoundEvent(self.sampling, self.expected_clients, self.population, self.noise_multiplier)

    def _server_event(self, contributors: int) -> RoundEvent | None:
        """Return what this round showed the server: ``c`` noise shares of ``z^2 / K`` each, no sampling."""
        if self.placement == "central" or contributors <= 0:
            return None
        return RoundEvent("poisson", 1, 1, self.noise_multiplier * math.sqrt(contributors / self.sampled))


def _delta(update: np.ndarray) -> np.ndarray:
    """Return the FedAvg family's per-client term: the delta itself."""
    return update
