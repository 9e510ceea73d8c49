"""Compressed updates end to end: bytes measured on the wire, secure aggregation, DP, the client's residual."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, RecordDict

from clients.mods import RESIDUAL_KEY, compression_mod
from core.compress import Codec
from core.instructions import TrainConfig, train_instruction
from core.replies import train_reply
from core.wire import wire_bytes
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
from tests.conftest import tiny_scenario

DENSE_REPLY = 650 * 4  # digits logistic regression: 64 x 10 weights + 10 biases, float32


def _per_client(db_url: str, run_id: str, column: str) -> list[int]:
    store = RunStore(db_url)
    return [getattr(c, column) for r in store.rounds(run_id) for c in store.client_results(run_id, r.round)]


def test_top_k_8_bit_run_learns_and_its_measured_uplink_shrinks(db_url: str) -> None:
    # Execute: the same federation dense and with top-k 25% in 8 bits
    dense = simulate(tiny_scenario(rounds=3), db_url=db_url)
    small = simulate(tiny_scenario(rounds=3, compression={"topk": 0.25, "bits": 8}), db_url=db_url)

    # Assert: both learn; each compressed reply carries 163 one-byte codes, a 4-byte scale and 163 one-byte
    # gaps between its coordinates (330 bytes of payload against 2,600), and the store holds what the
    # wire carried per client
    assert dense.status == small.status == "finished"
    assert small.final_accuracy > 0.8 and dense.final_accuracy > 0.8
    up_dense, up_small = _per_client(db_url, dense.run_id, "bytes_in"), _per_client(db_url, small.run_id, "bytes_in")
    assert all(DENSE_REPLY < b < DENSE_REPLY + 1500 for b in up_dense)
    assert all(330 < b < 330 + 1500 for b in up_small)
    # 2,270 bytes of payload saved per reply, less the framing of the one more array (index) it sends
    assert all(1700 < d - s < 2270 for d, s in zip(up_dense, up_small, strict=True))
    assert all(b > DENSE_REPLY for b in _per_client(db_url, small.run_id, "bytes_out"))


def test_downlink_16_bits_halves_the_broadcast(db_url: str) -> None:
    dense = simulate(tiny_scenario(rounds=1), db_url=db_url)
    half = simulate(tiny_scenario(rounds=1, compression={"downlink_bits": 16}), db_url=db_url)
    down_dense = _per_client(db_url, dense.run_id, "bytes_out")
    down_half = _per_client(db_url, half.run_id, "bytes_out")
    assert half.status == "finished" and half.final_accuracy > 0.6
    # the model's 2,600 bytes become 1,300; the message around it stays
    assert all(abs((d - h) - 1300) < 200 for d, h in zip(down_dense, down_half, strict=True))


def test_downlink_8_bits_run_trains_from_the_model_the_server_knows(db_url: str) -> None:
    summary = simulate(tiny_scenario(rounds=3, compression={"downlink_bits": 8}), db_url=db_url)
    assert summary.status == "finished" and summary.final_accuracy > 0.8


def test_random_k_under_secure_aggregation_masks_only_the_kept_coordinates(db_url: str) -> None:
    # Prepare
    secagg = {"enabled": True, "clip_range": 1.0, "threat_model": "semi-honest"}
    # Execute
    dense = simulate(tiny_scenario(rounds=2, secagg=secagg), db_url=db_url)
    sparse = simulate(tiny_scenario(rounds=4, secagg=secagg, compression={"randomk": 0.2}), db_url=db_url)

    # Assert: the masked vector is 130 + 1 uint32 values instead of 650 + 1, and the run still learns
    store = RunStore(db_url)
    masked = {run: next(s for s in store.rounds(run)[0].secagg["stages"] if s["stage"] == "masked_input")
              for run in (dense.run_id, sparse.run_id)}
    assert sparse.status == "finished" and sparse.final_accuracy > 0.6
    saved = masked[dense.run_id]["bytes_up"] - masked[sparse.run_id]["bytes_up"]
    assert saved == 4 * (4 * 650 - 4 * 130)  # four clients, 520 fewer uint32 values each
    # per client and round, over all of the protocol's stages as the wire carried them
    assert max(_per_client(db_url, sparse.run_id, "bytes_in")) + 2000 < min(_per_client(db_url, dense.run_id,
                                                                                         "bytes_in"))


def test_compression_leaves_the_dp_accounting_unchanged(db_url: str) -> None:
    # Prepare: central DP with and without random-k (the server clips the decoded update again)
    dp = {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 0.5, "sampling": "fixed"}
    # Execute
    plain = simulate(tiny_scenario(rounds=3, dp=dp), db_url=db_url)
    packed = simulate(tiny_scenario(rounds=3, dp=dp, compression={"randomk": 0.5, "bits": 8,
                                                                  "error_feedback": False}), db_url=db_url)

    # Assert: the same epsilon after every round
    store = RunStore(db_url)
    eps = [[r.epsilon for r in store.rounds(run)] for run in (plain.run_id, packed.run_id)]
    assert packed.status == "finished" and eps[0] == eps[1] and eps[0][-1] > 0


def test_an_oversized_compressed_reply_is_rejected_and_the_round_goes_on(db_url: str) -> None:
    # a 1 kB limit (the schema's unit is MB) refuses every dense reply, but not the top-k ones
    limit_mb = 1000 / 2**20
    summary = simulate(tiny_scenario(rounds=1, federation={"max_update_mb": limit_mb},
                                     compression={"topk": 0.1, "bits": 4}), db_url=db_url)
    dense = simulate(tiny_scenario(rounds=1, federation={"max_update_mb": limit_mb}), db_url=db_url)
    assert summary.status == "finished"
    assert {c for c in _outcomes(db_url, summary.run_id)} == {"ok"}
    assert {c for c in _outcomes(db_url, dense.run_id)} == {"rejected"}


def _outcomes(db_url: str, run_id: str) -> list[str]:
    return _per_client(db_url, run_id, "outcome")


def test_error_feedback_is_on_for_top_k_only_unless_set() -> None:
    assert tiny_scenario(compression={"topk": 0.1}).compression.feedback
    assert not tiny_scenario(compression={"randomk": 0.1}).compression.feedback
    assert not tiny_scenario(compression={"bits": 4}).compression.feedback
    assert tiny_scenario(compression={"randomk": 0.1, "error_feedback": True}).compression.feedback
    assert not tiny_scenario(compression={"topk": 0.1, "error_feedback": False}).compression.feedback
    # and DP takes random-k as it comes (no residual)
    assert tiny_scenario(dp={"enabled": True, "noise_multiplier": 1.0}, compression={"randomk": 0.1})


def test_under_dp_random_k_is_not_rescaled_so_a_clipped_update_keeps_its_norm() -> None:
    # Prepare: DP with random-k 10%: rescaling by d / k = 10 before the noise would multiply the sensitivity
    from aggregator.step import round_codec

    dp = {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 1.0}
    codec = round_codec(tiny_scenario(dp=dp, compression={"randomk": 0.1}), 1)
    plain = round_codec(tiny_scenario(compression={"randomk": 0.1}), 1)
    values = np.full(65, 1.0 / np.sqrt(65), dtype=np.float32)  # a clipped update's kept values: norm 1
    # Execute
    dense = codec.scatter(values, 650)
    # Assert: the released contribution has norm 1 = C; without DP the decoder rescales by 10
    assert not codec.rescale and plain.rescale
    assert float(np.linalg.norm(dense)) == pytest.approx(1.0, rel=1e-6)
    assert float(np.linalg.norm(plain.scatter(values, 650))) == pytest.approx(10.0, rel=1e-6)


def test_secure_aggregation_with_central_dp_and_random_k_keeps_the_accounting(db_url: str) -> None:
    dp = {"enabled": True, "noise_multiplier": 1.0, "clip_norm": 0.5, "sampling": "fixed"}
    secagg = {"enabled": True, "clip_range": 1.0, "threat_model": "semi-honest"}
    plain = simulate(tiny_scenario(rounds=2, dp=dp, secagg=secagg), db_url=db_url)
    sparse = simulate(tiny_scenario(rounds=2, dp=dp, secagg=secagg, compression={"randomk": 0.2}), db_url=db_url)
    store = RunStore(db_url)
    eps = [[r.epsilon for r in store.rounds(run)] for run in (plain.run_id, sparse.run_id)]
    assert sparse.status == "finished" and eps[0] == eps[1]


def test_client_keeps_its_residual_in_the_node_state_between_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):  # building a Message needs them
        monkeypatch.setattr(TaskIdentity, name, value, raising=False)
    # Prepare: a node's context, top-k 10% with error feedback
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    codec = Codec(topk=0.1)
    config = TrainConfig(round=1, epochs=1, batch_size=8, lr=0.1, seed=0).with_settings(codec.to_settings())
    first, second = np.arange(1, 21, dtype=np.float32), np.ones(20, dtype=np.float32)

    def compressed(delta: np.ndarray) -> dict:
        """The update the compression mod makes of a handler's reply with ``delta``."""
        message = Message(train_instruction(np.zeros(20, np.float32), config), dst_node_id=1, message_type="train")
        out = compression_mod(message, context, lambda m, _c: Message(train_reply(delta, 5, {}), reply_to=m))
        return dict(out.content["update"])

    # Execute
    sent1 = compressed(first)
    held = context.state[RESIDUAL_KEY]["residual"].numpy().copy()
    sent2 = compressed(second)
    # Assert: round 1 sends 19 and 20 and keeps 1..18; round 2 sends the largest of (1..18) + 1: 19 and 18
    assert isinstance(context.state[RESIDUAL_KEY], ArrayRecord)
    assert np.array_equal(codec.decode(sent1, 20), np.r_[np.zeros(18), 19, 20].astype(np.float32))
    assert np.array_equal(held, np.r_[np.arange(1, 19), 0, 0].astype(np.float32))
    assert np.array_equal(codec.decode(sent2, 20), np.r_[np.zeros(16), 18, 19, 0, 0].astype(np.float32))


def test_wire_bytes_counts_a_record_sent_under_two_names_once() -> None:
    content = train_instruction(np.zeros(1000, np.float32), TrainConfig(round=1, epochs=1, batch_size=8, lr=0.1,
                                                                        seed=0))
    reply = train_reply(np.zeros(1000, np.float32), 5, {"train-loss": 1.0})
    # the model (4,000 bytes + its .npy header) once, although 'arrays' and 'fitins.parameters' both name it
    assert 4000 < wire_bytes(content) < 4000 + 2000
    assert 4000 < wire_bytes(reply) < 4000 + 1000


@pytest.mark.parametrize("sections, key", [
    ({"secagg": {"enabled": True}, "compression": {"topk": 0.1}}, "compression.topk"),
    ({"secagg": {"enabled": True}, "compression": {"bits": 8}}, "compression.bits"),
    ({"dp": {"enabled": True, "noise_multiplier": 1.0}, "compression": {"topk": 0.1}}, "compression.error_feedback"),
    ({"dp": {"enabled": True, "noise_multiplier": 1.0}, "compression": {"randomk": 0.1, "error_feedback": True}},
     "compression.error_feedback"),
    ({"dp": {"enabled": True, "noise_multiplier": 1.0, "adaptive_clipping": True},
      "compression": {"randomk": 0.1, "error_feedback": False}}, "compression.randomk"),
    ({"compression": {"topk": 0.1, "randomk": 0.1}}, "compression.topk"),
    ({"compression": {"bits": 24}}, "compression.bits"),
    ({"compression": {"downlink_bits": 12}}, "compression.downlink_bits"),
    ({"compression": {"zip": True}}, "compression.zip"),
])
def test_scenario_refuses_what_compression_does_not_compose_with(sections, key) -> None:
    with pytest.raises(ScenarioError, match=key.replace(".", r"\.")):
        tiny_scenario(**sections)
