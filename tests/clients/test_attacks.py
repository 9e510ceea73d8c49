"""The attack harness: each attack's update transformation, worked out by hand."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict

from clients.attacks import AttackMod, AttackPlan, alie, alie_z, flip_labels, ipm, scaling, signflip
from core.instructions import TrainConfig, train_instruction
from core.replies import parse_train_reply, train_reply
from runtimes.faults import FaultPlan
from scenarios.threats import ByzantineSpec, FaultSpec

HONEST_ROWS = np.array([[1, 2], [3, 2]], dtype=np.float32)  # mean (2, 2), std (1, 0)


def test_signflip_and_scaling() -> None:
    x = np.array([1, -2], dtype=np.float32)
    np.testing.assert_array_equal(signflip(x), [-1, 2])
    np.testing.assert_array_equal(scaling(x, 10.0), [10, -20])


def test_alie_shifts_the_honest_mean_by_z_standard_deviations() -> None:
    # mean (2, 2) - 1.5 * std (1, 0) = (0.5, 2)
    np.testing.assert_allclose(alie(HONEST_ROWS, 1.5), [0.5, 2])


def test_ipm_sends_minus_epsilon_times_the_honest_mean() -> None:
    np.testing.assert_allclose(ipm(HONEST_ROWS, 0.5), [-1, -1])


def test_alie_z_follows_baruch_et_al() -> None:
    # n = 25, f = 5: s = floor(13.5) - 5 = 8; z = Phi^-1(17 / 25) = Phi^-1(0.68) = 0.4677
    assert alie_z(25, 5) == pytest.approx(0.4677, abs=1e-4)
    # n = 10, f = 5: s = 1, Phi^-1(0.9) = 1.2816
    assert alie_z(10, 5) == pytest.approx(1.2816, abs=1e-4)


def test_labelflip_maps_y_to_c_minus_1_minus_y() -> None:
    y = np.array([0, 3, 9], dtype=np.int64)
    flipped = flip_labels(y, 10)
    np.testing.assert_array_equal(flipped, [9, 6, 0])
    assert flipped.dtype == np.int64


def plan(attack: str, fraction: float = 0.2, clients: int = 25, **extra: object) -> AttackPlan:
    return AttackPlan(ByzantineSpec(fraction=fraction, attack=attack, **extra), clients, clients, seed=1)


def test_plan_picks_a_fixed_set_of_round_fraction_times_clients() -> None:
    # Prepare / Execute
    attackers = plan("alie").attackers()

    # Assert
    assert len(attackers) == 5 and attackers == tuple(sorted(set(attackers)))
    assert attackers == plan("signflip").attackers()  # the set does not depend on the attack
    assert plan("alie", fraction=0.0).attackers() == ()


def test_corruption_kinds_stay_transport_faults() -> None:
    # Prepare
    legacy = FaultSpec(byzantine=0.5, byzantine_kind="garbage")
    attack = FaultSpec(byzantine=ByzantineSpec(fraction=0.2, attack="alie"))

    # Execute / Assert: the mod ignores corruptions, the transport ignores attacks
    assert plan("garbage").attackers() == ()
    assert (FaultPlan.from_spec(legacy, 0).byzantine, FaultPlan.from_spec(legacy, 0).byzantine_kind) == (0.5, "garbage")
    assert FaultPlan.from_spec(attack, 0).byzantine == 0.0
    assert FaultPlan.from_spec(FaultSpec(byzantine=ByzantineSpec(0.3, "nan")), 0).byzantine == 0.3


class FakeTrainer:
    """Honest copies: partition p trains to (p, 1); with flipped labels to (-p, -1); 10 examples."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, partition: int, flip: bool, message: Message, context: Context):  # noqa: ARG002
        self.calls.append((partition, flip))
        sign = -1.0 if flip else 1.0
        return np.array([sign * partition, sign], dtype=np.float32), 10, {"train-loss": 0.1}


def forge(attack: str, **extra: object):
    p = plan(attack, clients=10, fraction=0.2, **extra)  # 2 attackers of 10
    trainer = FakeTrainer()
    mod = AttackMod(honest=trainer, plan_of=lambda _: p)
    delta, n, _ = mod.forge(p, p.attackers()[0], None, None)  # the fake trainer reads neither
    return p, trainer, delta, n


def test_each_attack_forges_the_update_from_honest_copies() -> None:
    p, _, _, _ = forge("ipm")
    a, b = p.attackers()
    honest_mean = np.array([(a + b) / 2, 1.0])
    std = np.array([abs(a - b) / 2, 0.0])

    assert forge("signflip")[2].tolist() == [-a, -1]
    assert forge("scaling", scale=3.0)[2].tolist() == [3 * a, 3]
    assert forge("labelflip")[2].tolist() == [-a, -1]
    assert forge("labelflip")[1].calls == [(a, True)]
    np.testing.assert_allclose(forge("ipm", epsilon=2.0)[2], -2 * honest_mean)
    np.testing.assert_allclose(forge("alie", z=1.0)[2], honest_mean - std)
    assert forge("mimic")[2].tolist() == [p.mimic_target(), 1]
    assert p.mimic_target() not in p.attackers()
    _, _, delta, n = forge("weight_inflation", inflated_examples=10**9)
    assert delta.tolist() == [-a, -1] and n == 10**9


def _through_mod(attack: str) -> tuple[AttackPlan, FakeTrainer, Callable[[int], Message]]:
    """An attack mod over 10 partitions whose honest path answers the update (1, 1) for 7 examples;
    returns the plan, the attackers' trainer and a function: partition -> the mod's train reply."""
    p = plan(attack, clients=10)
    trainer = FakeTrainer()
    mod = AttackMod(honest=trainer, plan_of=lambda _: p)
    content = train_instruction(np.zeros(2, dtype=np.float32),
                                TrainConfig(round=1, epochs=1, batch_size=1, lr=0.1, seed=0))

    def call_next(message: Message, context: Context) -> Message:
        return Message(train_reply(np.ones(2, dtype=np.float32), 7, {}), reply_to=message)

    def reply_of(partition: int) -> Message:
        context = Context(run_id=1, node_id=partition + 1, node_config={"partition-id": partition},
                          state=RecordDict(), run_config={})
        return mod(Message(content, dst_node_id=partition + 1, message_type="train"), context, call_next)

    return p, trainer, reply_of


@pytest.mark.usefixtures("task_identity")
def test_the_mod_forges_only_an_attacker_s_train_reply() -> None:
    # Prepare
    p, _, reply_of = _through_mod("signflip")
    honest_node, bad_node = next(i for i in range(10) if i not in p.attackers()), p.attackers()[0]

    # Execute
    honest, bad = (parse_train_reply(reply_of(n).content, 2, 2**20).delta for n in (honest_node, bad_node))

    # Assert
    np.testing.assert_array_equal(honest, [1, 1])
    np.testing.assert_array_equal(bad, [-bad_node, -1])


@pytest.mark.usefixtures("task_identity")
def test_an_absent_attacker_answers_an_error_and_an_honest_node_its_update() -> None:
    # Prepare
    p, trainer, reply_of = _through_mod("absent")
    honest_node, bad_node = next(i for i in range(10) if i not in p.attackers()), p.attackers()[0]

    # Execute
    honest, bad = reply_of(honest_node), reply_of(bad_node)

    # Assert: the attacker sends no update at all (and trains nothing); the honest node is untouched
    assert bad.has_error() and "withholds its update" in bad.error.reason
    assert trainer.calls == []
    np.testing.assert_array_equal(parse_train_reply(honest.content, 2, 2**20).delta, [1, 1])
    assert len(p.attackers()) == 2
