"""The pieces of the data-parallel mode that need no second process.

Numbers are worked out by hand: two ranks holding updates (1, 2) with weight 3
and (5, -2) with weight 1 have sums (3, 6) and (5, -2); the merged state is
(8, 4) with weight 4, so the mean is (2, 1).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F
from typer.testing import CliRunner

from aggregator.strategies import FedAvg
from core import aggregate
from core.strategy import sample_clients
from learning.federation import build_federation
from learning.models import build_model, get_flat
from learning.training import train
from runtimes.parallel.comm import Comm, bucket_views, pack, release_process_group, unpack, wire_for
from runtimes.parallel.errors import ParallelError
from runtimes.parallel.launch import LaunchSpec, check_spec, describe_failures, torchrun_command
from runtimes.parallel.localsgd import owned_nodes, round_nodes, train_steps
from runtimes.parallel.mode import Mode
from runtimes.parallel.shards import assign_clients, epoch_batches, steps_per_epoch
from runtimes.parallel.sync import SyncSGD
from scenarios.schema import load_scenario
from scenarios.sections import DataSpec


def _state(update: list[float], weight: float) -> aggregate.MeanState:
    return aggregate.add(aggregate.empty(len(update)), np.array(update, dtype=np.float32), weight)


def test_summing_two_wires_is_core_merge_and_gives_the_weighted_mean():
    # Prepare
    wires = [wire_for(2).numpy(), wire_for(2).numpy()]
    pack(_state([1, 2], 3), wires[0])
    pack(_state([5, -2], 1), wires[1])
    # Execute: what a SUM all-reduce does
    merged = unpack(wires[0] + wires[1])
    # Assert
    assert (merged.weight, merged.count) == (4.0, 2)
    np.testing.assert_array_equal(merged.total, [8, 4])
    np.testing.assert_array_equal(aggregate.finalize(merged), [2, 1])


def test_an_empty_rank_sends_the_identity():
    wires = [wire_for(2).numpy(), wire_for(2).numpy()]
    pack(_state([1, 2], 3), wires[0])
    pack(aggregate.empty(2), wires[1])
    np.testing.assert_array_equal(aggregate.finalize(unpack(wires[0] + wires[1])), [1, 2])


def test_pack_does_not_copy_sums_that_already_live_in_the_wire():
    wire = wire_for(3)
    sums = wire.numpy()[:3]
    sums[:] = [1, 2, 3]
    pack(aggregate.MeanState(total=sums, weight=2.0, count=1), wire.numpy())
    np.testing.assert_array_equal(wire.numpy(), [1, 2, 3, 2, 1])


def test_buckets_are_views_covering_the_buffer_in_order():
    buffer = torch.arange(10, dtype=torch.float32)
    views = bucket_views(buffer, bucket_bytes=16)  # 4 floats each
    assert [v.numel() for v in views] == [4, 4, 2]
    views[2][0] = -1
    assert buffer[8] == -1
    assert len(bucket_views(buffer, 25 * 2**20)) == 1
    with pytest.raises(ValueError):
        bucket_views(buffer, 2)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_release_joins_gloo_threads_before_the_interpreter_exits():
    # Prepare: a one-rank gloo group that has run an async all-reduce, its handles dropped
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10))
    before = _threads()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        buffer = torch.ones(8)
        Comm(rank=0, world=2, timeout_s=10).allreduce_(buffer)  # world=2 forces the real collective
        running = _threads()
    finally:
        # Act
        release_process_group()

    # Assert: the group's threads existed and none outlives the release
    assert buffer.tolist() == [1.0] * 8
    assert running > before
    assert _threads() == before
    assert not dist.is_initialized()


def test_single_rank_sync_step_is_plain_sgd_on_the_mean_loss():
    # Prepare
    torch.manual_seed(0)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    ours, ref = (build_model("mlp", (1, 8, 8), 10, seed=3) for _ in range(2))
    trainer = SyncSGD(ours, Comm(rank=0, world=1, timeout_s=1), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    # Execute
    for _ in range(3):
        trainer.step(x, y)
        optimizer.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        optimizer.step()
    # Assert: same model; one wire of P + 2 floats per step went to the collective.
    np.testing.assert_allclose(get_flat(ours), get_flat(ref), rtol=0, atol=1e-6)
    assert trainer.comm.bytes_sent == 3 * (trainer.size + 2) * 4
    momentum = trainer.momentum()
    fresh = SyncSGD(build_model("mlp", (1, 8, 8), 10, seed=3), Comm(0, 1, 1), lr=0.1, momentum=0.9)
    fresh.load_momentum(momentum)
    np.testing.assert_array_equal(fresh.momentum(), momentum)


def test_train_steps_equals_train_for_whole_epochs():
    fed = build_federation(DataSpec(dataset="digits", partition="iid"), 2, seed=0)
    data = fed.clients[0].train
    a, b = (build_model("logreg", fed.input_shape, fed.num_classes, seed=1) for _ in range(2))
    steps = 2 * math.ceil(len(data) / 16)
    train(a, data, epochs=2, batch_size=16, lr=0.1, momentum=0.5, seed=9)
    train_steps(b, data, steps=steps, batch_size=16, lr=0.1, momentum=0.5, seed=9)
    np.testing.assert_array_equal(get_flat(a), get_flat(b))


def test_clients_are_dealt_round_robin_and_too_many_workers_is_an_error():
    assert assign_clients(5, 2) == [[0, 2, 4], [1, 3]]
    assert assign_clients(2, 2) == [[0], [1]]
    with pytest.raises(ParallelError, match="3 workers but the scenario has only 2 clients"):
        assign_clients(2, 3)
    assert steps_per_epoch([33, 10], 16) == 3
    assert [b.tolist() for b in epoch_batches(torch.arange(7), 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(b) for b in epoch_batches(torch.arange(2), 3)] == [1, 1, 0]  # an empty batch: the identity


def test_local_sgd_samples_like_the_round_loop_and_splits_nodes_over_ranks(scenario_file):
    scenario = load_scenario(scenario_file(clients=6, fraction=0.5))
    nodes = round_nodes(FedAvg(), scenario, 4)
    assert nodes == sample_clients(FedAvg(), [1, 2, 3, 4, 5, 6], 3, scenario.seed, 4)
    assert sorted(owned_nodes(nodes, 0, 2) + owned_nodes(nodes, 1, 2)) == nodes
    assert all((n - 1) % 2 == 1 for n in owned_nodes(nodes, 1, 2))


def test_launch_checks_fail_before_any_process_starts(scenario_file):
    path = scenario_file(clients=2)
    with pytest.raises(ParallelError, match="3 workers but the scenario has only 2 clients"):
        check_spec(LaunchSpec(scenario=path, nproc=3))
    with pytest.raises(ParallelError, match="only the localsgd mode takes local steps"):
        check_spec(LaunchSpec(scenario=path, local_steps=5))
    command = torchrun_command(LaunchSpec(scenario=path, nproc=2))
    assert "-m torch.distributed.run --standalone --nproc-per-node 2" in command
    assert "-m runtimes.parallel.worker --scenario" in command


def test_failures_are_described_root_cause_first():
    def failure(pid, exitcode, message="", timestamp=0):
        name = {-9: "SIGKILL", -15: "SIGTERM"}.get(exitcode, "<N/A>")
        return SimpleNamespace(pid=pid, exitcode=exitcode, timestamp=timestamp, signal_name=lambda: name,
                               message={"message": message} if message else "To enable traceback see: ...")

    text = describe_failures({0: failure(10, 1, "WorkerLost: rank 0: all_reduce failed", timestamp=1),
                              1: failure(11, -9, timestamp=2), 2: failure(12, -15, timestamp=0),
                              3: failure(13, 1, timestamp=3)})
    assert text == ("rank 1 (pid 11) was killed by SIGKILL; "
                    "rank 0 (pid 10) exited with code 1: WorkerLost: rank 0: all_reduce failed; "
                    "rank 3 (pid 13) exited with code 1; "
                    "rank 2 (pid 12) was killed by SIGTERM")


def test_cli_prints_the_equivalent_torchrun_command(scenario_file):
    import typer

    from runtimes.parallel.cli import parallel

    app = typer.Typer()
    app.command()(parallel)
    result = CliRunner().invoke(app, [str(scenario_file()), "--nproc", "2", "--mode", "localsgd",
                                      "--local-steps", "5", "--print-command"])
    assert result.exit_code == 0, result.output
    assert "--mode localsgd --local-steps 5" in result.output


def _one_rank_job(scenario_path, mode, **overrides):
    from runtimes.parallel.job import JobSpec, build_job

    scenario = load_scenario(scenario_path)
    if overrides:
        scenario = scenario.with_overrides(**overrides)
    return build_job(JobSpec(scenario, mode), Comm(rank=0, world=1, timeout_s=5))


def test_a_dp_local_sgd_round_runs_through_the_strategy_and_records_epsilon(scenario_file):
    # Prepare: central DP-FedAvg, every client sampled (one rank holds them all).
    from runtimes.parallel.job import initial_state, run_round
    from runtimes.parallel.runlog import round_record

    dp = {"enabled": True, "clip_norm": 0.5, "noise_multiplier": 0.8, "sampling": "fixed"}
    job = _one_rank_job(scenario_file(clients=4, fraction=0.5), Mode.LOCALSGD, dp=dp)
    state = initial_state(job)
    # Execute
    result = run_round(job, state, 1)
    record = round_record(job, result, 1, 0.0, 0.1, None)
    # Assert: 2 of 4 clients trained, the model moved, the DP accountant advanced.
    assert (result.status, record.sampled) == ("ok", 2)
    assert not np.array_equal(result.state.params, state.params)
    assert record.epsilon is not None and record.epsilon > 0
    assert result.bytes_sent >= (state.params.size + 2) * 4  # at least the merge of the aggregate


def test_dp_scenarios_need_the_local_sgd_mode(scenario_file, tmp_path):
    path = tmp_path / "dp.toml"
    path.write_text(scenario_file().read_text() + "[dp]\nenabled = true\nnoise_multiplier = 1.0\n")
    with pytest.raises(ParallelError, match="use --mode localsgd"):
        check_spec(LaunchSpec(scenario=path))


@pytest.mark.parametrize(("faults", "key"), [
    ('byzantine = { fraction = 0.25, attack = "signflip" }', "faults.byzantine.fraction = 0.25"),
    ("byzantine = 0.25", "faults.byzantine = 0.25"),
    ("dropouts = { train = 0.5 }", "faults.dropouts.train = 0.5"),
    ("stragglers = 0.5\nstraggler_delay_s = 1.0", "faults.stragglers = 0.5"),
])
def test_faults_are_refused_by_key_since_no_rank_sends_a_clientapp_message(scenario_file, tmp_path, faults, key):
    # Prepare: a scenario the data-parallel mode would otherwise run
    path = tmp_path / "faults.toml"
    path.write_text(scenario_file().read_text() + f"[faults]\n{faults}\n")

    # Execute / Assert: refused before any process starts, naming the key and the way out
    with pytest.raises(ParallelError, match=rf"{key}: .*run this scenario with quorum simulate"):
        check_spec(LaunchSpec(scenario=path, mode=Mode.LOCALSGD))
    check_spec(LaunchSpec(scenario=scenario_file(), mode=Mode.LOCALSGD))  # without [faults] it is accepted
