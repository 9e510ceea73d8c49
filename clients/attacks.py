"""Byzantine clients for experiments: a ClientApp mod that forges valid-looking updates.

``[faults] byzantine = { fraction = 0.2, attack = "alie" }`` makes a fixed set of
``round(fraction * clients)`` simulated clients (chosen from the scenario seed)
attack every round they are sampled in. The attack runs in the ClientApp, so
it works on every runtime that runs it on simulated partitions (in-process,
Ray, SuperNodes given a ``partition-id``; the data-parallel mode runs no
ClientApp and refuses ``[faults]``); the
replies are well formed, so only robust aggregation can blunt them. (The
corrupt-reply kinds ``nan``, ``wrong_shape``, ``oversized`` and ``garbage``
stay transport faults: ``runtimes.faults``.)

Attacks
-------
``signflip``
    ``-x``: the honest update reversed (bit flipping in Karimireddy et al. 2021).
``scaling``
    ``scale * x`` (model-replacement boosting, Bagdasaryan et al. 2020).
``labelflip``
    Trains on labels ``y -> C - 1 - y``.
``weight_inflation``
    The honest update reversed (``-x``), reporting ``inflated_examples``
    examples: a mean that trusts the count is steered backwards by the
    attackers alone (the issue's 10^12 attack). Rules that weigh every
    update 1 see a sign flip.
``alie``
    "A little is enough" (Baruch, Baruch & Goldberg, NeurIPS 2019):
    ``mu - z * sigma`` coordinate-wise, with ``z`` from the paper's
    ``z_max = Phi^-1((n - s) / n)``, ``s = floor(n / 2 + 1) - f``.
``ipm``
    Inner-product manipulation (Xie, Koyejo & Gupta, UAI 2020): ``-epsilon * mu``.
``mimic``
    Every attacker sends the update of one fixed honest client
    (Karimireddy, He & Jaggi, ICLR 2022), over-weighting its data.
``absent``
    The attackers take the model and never send an update (their train
    calls fail): no rule can learn their data, so the drop under ``absent``
    is what their data is worth, a floor under every defence's drop (none
    with ``data = "iid"``, where the attackers hold copies).

Knowledge assumed
-----------------
ALIE and IPM need the honest updates' mean ``mu`` (and ALIE the std
``sigma``). As in Baruch et al., the colluding attackers estimate them from
their *own* honest updates: each attacker trains an honest copy of the global
model on every attacker's partition (the simulated federation's data is in
the process) and takes the statistics over those ``f`` updates; mimic trains
a copy on its target's partition. Copies are cached per round and process.
A node that names its own data file (``data-path``) is never an attacker:
the harness is for simulated federations. It forges plain train replies, so
a scenario refuses it together with secure aggregation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from flwr.app import Context, Error, Message

from core.replies import train_reply
from learning.standardize import asks_for_statistics
from scenarios.schema import Scenario
from scenarios.threats import ByzantineSpec

__all__ = ["AttackPlan", "alie", "alie_z", "ipm", "signflip", "scaling", "flip_labels", "AttackMod",
           "HonestTrainer"]

#: ``(partition, flip_labels, message) -> (delta, num_examples, metrics)``: an honest
#: copy trained on a partition for the round of ``message`` (the ClientApp's own training).
HonestTrainer = Callable[[int, bool, Message, Context], tuple[np.ndarray, int, dict[str, float]]]


def signflip(update: np.ndarray) -> np.ndarray:
    """``-x``."""
    return (-update).astype(np.float32)


def scaling(update: np.ndarray, scale: float) -> np.ndarray:
    """``scale * x``."""
    return (np.float32(scale) * update).astype(np.float32)


def ipm(honest: np.ndarray, epsilon: float) -> np.ndarray:
    """``-epsilon * mean(honest)`` over the rows of ``honest`` (Xie et al., UAI 2020)."""
    mean: np.ndarray = honest.mean(axis=0)
    return (-np.float32(epsilon) * mean).astype(np.float32)


def alie(honest: np.ndarray, z: float) -> np.ndarray:
    """``mean - z * std`` coordinate-wise over the rows of ``honest`` (Baruch et al., NeurIPS 2019)."""
    mean: np.ndarray = honest.mean(axis=0)
    std: np.ndarray = honest.std(axis=0)
    return (mean - np.float32(z) * std).astype(np.float32)


def alie_z(n: int, f: int) -> float:
    """Baruch et al.'s ``z_max``: enough honest-looking to stay a majority's neighbour.

    ``s = floor(n / 2 + 1) - f`` honest workers must be further from the mean
    than the attackers; ``z = Phi^-1((n - s) / n)``. Floored at 0.1 so that
    ALIE always moves (for ``f`` near ``n / 2`` the formula gives 0 or less).
    """
    s = math.floor(n / 2 + 1) - f
    quantile = min(max((n - s) / n, 1e-6), 1 - 1e-6)
    return max(0.1, NormalDist().inv_cdf(quantile))


def flip_labels(y: np.ndarray, num_classes: int) -> np.ndarray:
    """``y -> C - 1 - y``."""
    return (num_classes - 1 - y).astype(y.dtype)


@dataclass(frozen=True)
class AttackPlan:
    """Which simulated partitions attack, and how: a pure function of the scenario.

    Parameters
    ----------
    spec : ByzantineSpec
        The scenario's ``[faults] byzantine`` table.
    num_clients : int
        Partitions in the federation.
    per_round : int
        Clients sampled per round (ALIE's ``n``).
    seed : int
        The scenario seed.
    """

    spec: ByzantineSpec
    num_clients: int
    per_round: int
    seed: int

    @classmethod
    def from_scenario(cls, scenario: Scenario) -> AttackPlan:
        """Return the plan of ``scenario``'s ``[faults] byzantine``, its federation and its seed."""
        fed = scenario.federation
        return cls(scenario.faults.byzantine_spec, fed.clients, fed.per_round, scenario.seed)

    @property
    def active(self) -> bool:
        """Whether the scenario asks for one of this module's attacks."""
        return self.spec.active

    def attackers(self) -> tuple[int, ...]:
        """Return the attacking partition ids, sorted: ``round(fraction * clients)`` of them."""
        return self.spec.attackers(self.num_clients, self.seed)

    def mimic_target(self) -> int:
        """Return the honest partition every mimic attacker copies: the lowest-numbered one."""
        bad = set(self.attackers())
        return next(p for p in range(self.num_clients) if p not in bad)

    def z(self) -> float:
        """ALIE's ``z``: the scenario's, or ``z_max`` for ``n`` sampled clients and the expected attackers."""
        if self.spec.z is not None:
            return self.spec.z
        expected = max(1, round(self.spec.fraction * self.per_round))
        return alie_z(self.per_round, expected)


@dataclass(frozen=True)
class AttackMod:
    """The ClientApp mod: honest nodes pass through; an attacker's train reply is forged.

    Parameters
    ----------
    honest : HonestTrainer
        Trains an honest copy for a partition (the ClientApp supplies its own training).
    plan_of : Callable[[Context], AttackPlan]
        The attack plan of the context's run.
    """

    honest: HonestTrainer
    plan_of: Callable[[Context], AttackPlan]

    def __call__(self, message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        """Answer ``message``: honestly (``call_next``), or with an attacker's forged train reply.

        Only a train message to a simulated attacker's partition is forged;
        secure-aggregation and statistics messages are answered honestly. An
        ``absent`` attacker replies with an error instead of an update.
        """
        partition = context.node_config.get("partition-id")
        if message.metadata.message_type.split(".")[0] != "train" or not isinstance(partition, int):
            return call_next(message, context)
        plan = self.plan_of(context)
        if int(partition) not in plan.attackers() or "secagg" in message.content.config_records \
                or asks_for_statistics(message.content):  # the pass is answered honestly
            return call_next(message, context)
        if plan.spec.attack == "absent":
            return Message(Error(code=1, reason="absent: this client withholds its update"), reply_to=message)
        delta, num_examples, metrics = self.forge(plan, int(partition), message, context)
        return Message(train_reply(delta, num_examples, metrics), reply_to=message)

    def forge(self, plan: AttackPlan, partition: int, message: Message,
              context: Context) -> tuple[np.ndarray, int, dict[str, float]]:
        """Forge the attacker's update, example count and metrics for this round."""
        spec = plan.spec
        delta, n, metrics = self.honest(partition, spec.attack == "labelflip", message, context)
        if spec.attack in ("alie", "ipm"):
            rows = np.stack([self.honest(p, False, message, context)[0] for p in plan.attackers()])
            delta = alie(rows, plan.z()) if spec.attack == "alie" else ipm(rows, spec.epsilon)
        elif spec.attack == "mimic":
            delta = self.honest(plan.mimic_target(), False, message, context)[0]
        elif spec.attack == "signflip":
            delta = signflip(delta)
        elif spec.attack == "scaling":
            delta = scaling(delta, spec.scale)
        elif spec.attack == "weight_inflation":
            delta, n = signflip(delta), spec.inflated_examples
        return delta, n, metrics

