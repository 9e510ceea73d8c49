"""Compression in the data-parallel mode: torch's DDP hooks (sync) and Quorum's encoders (local SGD)."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from parallel_support import reference_sync
from torch.nn import functional as F

from learning.models import build_model, get_flat
from runstore.store import RunStore
from runtimes.parallel.comm import Comm, release_process_group
from runtimes.parallel.errors import ParallelError
from runtimes.parallel.hooks import HookedSyncSGD, step_totals
from runtimes.parallel.job import JobSpec, build_job, initial_state, run_round
from runtimes.parallel.launch import LaunchSpec, check_spec
from runtimes.parallel.mode import CommHook, Mode
from runtimes.simulation import simulate
from scenarios.schema import load_scenario

JOB_TIMEOUT = 120


@pytest.fixture
def one_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)  # a file, not a TCP store: no socket for one rank
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        yield
    finally:
        release_process_group()


def test_step_totals_follow_tensor_split():
    # shards of 5 and 2 examples in 3 steps: tensor_split gives (2, 2, 1) and (1, 1, 0)
    assert step_totals([5, 2], 3) == [3, 3, 1]
    assert [len(p) for p in torch.tensor_split(torch.arange(5), 3)] == [2, 2, 1]


@pytest.mark.e2e  # gloo listens on a loopback socket, even for one rank
@pytest.mark.parametrize("hook", [CommHook.FP16, CommHook.POWERSGD])
def test_one_rank_hooked_step_is_sgd_on_the_hooks_gradient(one_rank_group, hook):
    # Prepare: fp16 rounds every gradient to half precision; PowerSGD's first two steps are uncompressed
    torch.manual_seed(0)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    ours, ref = (build_model("mlp", (1, 8, 8), 10, seed=3) for _ in range(2))
    trainer = HookedSyncSGD(ours, Comm(rank=0, world=1, timeout_s=5), hook, (1, 8, 8), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    trainer.begin_epoch([8], 1)
    # Execute
    for _ in range(2):
        trainer.step(x, y, 0)
        optimizer.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        if hook is CommHook.FP16:
            for p in ref.parameters():
                p.grad = p.grad.half().float()
        optimizer.step()
    # Assert: the same model; the hook's payload counted (fp16: two bytes a value)
    np.testing.assert_allclose(get_flat(ours), get_flat(ref), rtol=0, atol=1e-6)
    if hook is CommHook.FP16:
        assert trainer.comm.bytes_sent == 2 * 2 * trainer.size


@pytest.mark.e2e  # gloo listens on a loopback socket, even for one rank
def test_powersgd_bytes_follow_torchs_own_compression_rule(one_rank_group):
    # Prepare: logistic regression, a 10 x 64 weight and 10 biases. PowerSGD sends its first two steps
    # whole (650 values); then the weight as rank-1 factors, 10 + 64 = 74 values (640 > 2 x 74: worth it),
    # and the 10 biases in full: 84 values, four bytes each
    model = build_model("logreg", (1, 8, 8), 10, seed=1)
    trainer = HookedSyncSGD(model, Comm(rank=0, world=1, timeout_s=5), CommHook.POWERSGD, (1, 8, 8), lr=0.1)
    trainer.begin_epoch([8], 1)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    # Execute
    for _ in range(3):
        trainer.step(x, y, 0)
    # Assert
    assert trainer.comm.bytes_sent == 4 * (650 + 650 + 84)


def test_resuming_with_another_hook_is_refused(tmp_path):
    from runtimes.parallel.launch import _check_resumable
    from runtimes.parallel.runlog import create_run

    scenario_path = tmp_path / "s.toml"
    scenario_path.write_text('name = "s"\n[data]\ndataset = "digits"\n[model]\nname = "logreg"\n')
    store = RunStore(f"sqlite:///{tmp_path / 'r.db'}")
    run_id = create_run(store, load_scenario(scenario_path), Mode.SYNC, 650, {"mode": "sync", "comm_hook": "powersgd"})
    with pytest.raises(ParallelError, match="--comm-hook powersgd; resume it with the same hook, not none"):
        _check_resumable(store, LaunchSpec(scenario=scenario_path), run_id)
    _check_resumable(store, LaunchSpec(scenario=scenario_path, comm_hook=CommHook.POWERSGD), run_id)


def test_bf16_is_refused_before_any_worker_starts(scenario_file):
    with pytest.raises(ParallelError, match="NCCL"):
        check_spec(LaunchSpec(scenario=scenario_file(), comm_hook=CommHook.BF16))


@pytest.mark.e2e  # gloo listens on a loopback socket, even for one rank
def test_an_empty_batch_still_joins_the_step_and_moves_nothing(one_rank_group):
    model = build_model("logreg", (1, 8, 8), 10, seed=1)
    before = get_flat(model).copy()
    trainer = HookedSyncSGD(model, Comm(rank=0, world=1, timeout_s=5), CommHook.FP16, (1, 8, 8), lr=0.5)
    trainer.begin_epoch([0], 1)
    assert trainer.step(torch.empty(0, 1, 8, 8), torch.empty(0, dtype=torch.long), 0) == 0.0
    np.testing.assert_array_equal(get_flat(model), before)


@pytest.mark.e2e
def test_two_rank_fp16_hook_tracks_sgd_on_concatenated_batches(start_job, scenario_file, db_url):
    # Prepare: uneven shards (3 clients over 2 ranks), so the W / B weighting matters
    path = scenario_file(clients=3, rounds=2, momentum=0.5, federated="false")
    scenario = load_scenario(path)
    # Execute
    rc, _, err = start_job([str(path), "--nproc", "2", "--db", db_url, "--json", "--comm-hook", "fp16"]).wait(
        JOB_TIMEOUT)
    # Assert: the exact weighted step, up to half-precision gradients
    assert rc == 0, err
    store = RunStore(db_url)
    run = store.list_runs()[0]
    params = store.load_state(run.id).params
    np.testing.assert_allclose(params, reference_sync(scenario, world=2), rtol=0, atol=2e-3)
    assert run.info["comm_hook"] == "fp16" and run.status == "finished"


def test_local_sgd_compresses_client_updates_as_the_federated_run_does(scenario_file, tmp_path):
    # Prepare: top-k 10% in 8 bits with error feedback, half the clients a round (the residuals carry over;
    # stochastic rounding draws from the round and node, as the ClientApp does)
    path = scenario_file(clients=4, fraction=0.5, rounds=3, momentum=0.0, federated="false")
    path.write_text(path.read_text() + "[compression]\ntopk = 0.1\nbits = 8\n")
    scenario = load_scenario(path)
    torch.set_num_threads(1)
    sim = simulate(scenario, db_url=f"sqlite:///{tmp_path / 'sim.db'}")
    expected = RunStore(sim.db).load_state(sim.run_id).params
    job = build_job(JobSpec(scenario, Mode.LOCALSGD), Comm(rank=0, world=1, timeout_s=5))
    state = initial_state(job)
    # Execute
    for k in range(1, 4):
        state = run_round(job, state, k).state
    # Assert: the same model as the in-process federation, and residuals held for the clients that trained
    np.testing.assert_allclose(state.params, expected, rtol=0, atol=1e-5)
    assert job.residuals and all(r.shape == state.params.shape for r in job.residuals.values())


def test_launch_refuses_what_does_not_apply(scenario_file, tmp_path):
    path = scenario_file()
    with pytest.raises(ParallelError, match="comm_hook"):
        check_spec(LaunchSpec(scenario=path, mode=Mode.LOCALSGD, comm_hook=CommHook.FP16))
    topk = tmp_path / "topk.toml"
    topk.write_text(path.read_text() + "[compression]\ntopk = 0.1\n")
    with pytest.raises(ParallelError, match="--comm-hook"):
        check_spec(LaunchSpec(scenario=topk))
    down = tmp_path / "down.toml"
    down.write_text(path.read_text() + "[compression]\ndownlink_bits = 16\n")
    with pytest.raises(ParallelError, match="downlink_bits"):
        check_spec(LaunchSpec(scenario=down, mode=Mode.LOCALSGD))


@pytest.mark.parametrize(("field", "value"), [("timeout_s", 1e308), ("timeout_s", float("inf")),
                                              ("timeout_s", float("nan")), ("timeout_s", 0.0),
                                              ("bucket_mb", 1e308), ("bucket_mb", float("nan")), ("bucket_mb", -1.0)])
def test_a_launch_setting_beyond_its_range_is_refused_before_any_worker(field: str, value: float,
                                                                      scenario_file) -> None:
    # 1e308 s overflowed torch's timedelta in the worker; a huge bucket, the allocation
    with pytest.raises(ParallelError, match=rf"{field.removesuffix('_s')} = .*: out of range"):
        check_spec(LaunchSpec(scenario=scenario_file(), **{field: value}))
