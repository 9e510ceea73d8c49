"""``[data] standardize = "federated"`` in a run (issue 17, item 4): the statistics pass, its attackers, its use.

The pooled mean and std are worked out with numpy from the clients' own rows;
the run must find them from the count-weighted pass vectors alone, under
plain and secure aggregation. A client whose pass vector leaves the limits
(here 10^6 in every value) is rejected like an oversized update; one within
them moves the statistics by its weight, as any client's data would.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Message, RecordDict
from sklearn.datasets import load_digits

from aggregator.serverapp import run_federation
from core.eval_replies import eval_reply
from core.instructions import STD_LIMIT, STD_MEAN, STD_PASS, STD_SCALES, TrainConfig, parse_instruction
from core.replies import train_reply
from learning.standardize import (
    Standardization,
    asks_for_statistics,
    statistics_vector,
)
from learning.task import load_task
from quorum.export import export_run, load_model
from runstore.store import RunStore
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.simulation import simulate
from scenarios.errors import ScenarioError
from scenarios.schema import scenario_from_dict
from tests.conftest import tiny_scenario

FEATURES = 64


def device_rows(node: int) -> np.ndarray:
    """Node k's raw rows: 80 + 20 k of them, pixels 0-255 shifted by 10 k."""
    rng = np.random.default_rng(node)
    return (rng.integers(0, 256, size=(80 + 20 * node, FEATURES)) + 10 * node).astype(np.float32)


def scripted_devices(liar: int | None, seen: list[Standardization]):
    """Clients answering the passes from :func:`device_rows`; ``liar`` sends 10^6 in every statistic."""
    def app(message: Message, context) -> Message:
        node = context.node_id
        if asks_for_statistics(message.content):
            settings = TrainConfig.from_record(message.content.config_records["config"])
            vector = statistics_vector(device_rows(node), settings.get(STD_PASS), settings.get(STD_LIMIT),
                                       settings.get(STD_SCALES), settings.get(STD_MEAN))
            if node == liar:
                vector = np.full_like(vector, 1e6)
            return Message(train_reply(vector, len(device_rows(node)), {}), reply_to=message)
        params, config = parse_instruction(message.content)
        found = Standardization.from_config(config)
        assert found is not None
        seen.append(found)
        content: RecordDict = (eval_reply(0.5, 0.5, 10) if message.metadata.message_type == "evaluate"
                               else train_reply(np.zeros_like(params), 100, {"train-loss": 0.5}))
        return Message(content, reply_to=message)
    return app


def run_scripted(app, db_url: str, clients: int = 4):
    scenario = tiny_scenario(data={"standardize": "federated"}, evaluation={"federated": True, "server": False},
                             federation={"clients": clients})
    store = RunStore(db_url)
    with InProcessGrid(app, [NodeSpec(i + 1, {}) for i in range(clients)], {}) as grid:
        run_id, result = run_federation(grid, scenario, store, engine="inprocess")
    return store, run_id, result


def test_the_pass_finds_the_pooled_mean_and_std_and_refuses_a_lying_client(db_url: str) -> None:
    seen: list[Standardization] = []
    store, run_id, result = run_scripted(scripted_devices(liar=4, seen=seen), db_url)
    assert result.status == "finished"
    pooled = np.concatenate([device_rows(k) for k in (1, 2, 3)]).astype(np.float64)
    info = store.get_run(run_id).info["standardization"]
    np.testing.assert_allclose(info["mean"], pooled.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(info["std"], pooled.std(axis=0), rtol=1e-5)
    # every train and evaluate instruction of both rounds carried it
    assert len(seen) == 2 * 4 + 2 * 4
    np.testing.assert_allclose(seen[-1].mean, info["mean"], rtol=1e-6)
    messages = [e.message for e in store.events(run_id)]
    # values up to 255 + 30: every feature's mean and rms within 256
    assert any("64 features from 3 of 4 clients (scales 256 .. 256)" in m for m in messages), messages


def test_a_run_whose_pass_nobody_answers_fails_with_the_reason(db_url: str) -> None:
    def app(message: Message, context) -> Message:
        raise RuntimeError("device data unreadable")
    with pytest.raises(Exception, match="statistics pass"):
        run_scripted(app, db_url, clients=2)
    store = RunStore(db_url)
    (run,) = store.list_runs()
    assert run.status == "failed" and "no client answered the flags statistics pass" in run.error


def test_the_pass_is_refused_beside_dp_naming_both_keys() -> None:
    with pytest.raises(ScenarioError, match=r"data\.standardize.*\[dp\] enabled = true"):
        tiny_scenario(data={"standardize": "federated"}, dp={"enabled": True, "noise_multiplier": 1.0,
                                                               "clip_norm": 1.0})
    with pytest.raises(ScenarioError, match="standardize"):
        tiny_scenario(data={"standardize": "yes"})


@pytest.fixture(scope="module")
def raw_digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scikit-learn's digits as a device holds raw pixels: 0-256, not scaled."""
    path = tmp_path_factory.mktemp("digits") / "digits.csv"
    digits = load_digits()
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([f"p{i}" for i in range(FEATURES)] + ["label"])
        for row, label in zip(digits.data * 16, digits.target, strict=True):
            writer.writerow([f"{v:g}" for v in row] + [int(label)])
    return path


def digits_scenario(path: Path, standardize: str, secagg: bool = False):
    return scenario_from_dict({
        "name": "raw-digits", "seed": 2, "rounds": 3,
        "data": {"dataset": "file", "path": str(path), "partition": "iid", "standardize": standardize},
        "model": {"name": "mlp"}, "federation": {"clients": 4, "min_clients": 2},
        "training": {"local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "secagg": {"enabled": secagg}}, source="test")


def test_raw_pixels_train_once_standardised_and_secure_aggregation_finds_the_same_statistics(
        raw_digits: Path, tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    raw = simulate(digits_scenario(raw_digits, "none"), db_url=db, workers=1)
    plain = simulate(digits_scenario(raw_digits, "federated"), db_url=db, workers=1)
    secure = simulate(digits_scenario(raw_digits, "federated", secagg=True), db_url=db, workers=1)
    assert raw.final_accuracy < 0.3  # 0-256 inputs: the steps explode
    assert plain.final_accuracy > raw.final_accuracy + 0.3
    store = RunStore(db)
    found = {s.run_id: store.get_run(s.run_id).info["standardization"] for s in (plain, secure)}
    # the clients' own training rows, pooled (iid shares: equal weights by count)
    scenario = digits_scenario(raw_digits, "federated")
    task = load_task(scenario)
    pooled = np.concatenate([task.partition(i).train.x for i in range(4)]).astype(np.float64)
    for info in found.values():
        np.testing.assert_allclose(info["mean"], pooled.mean(axis=0), rtol=1e-5, atol=1e-6)
        varying = pooled.std(axis=0) > 0  # a column of zeros on every device: centred, std 1
        np.testing.assert_allclose(np.array(info["std"])[varying], pooled.std(axis=0)[varying], rtol=1e-5)
        assert (np.array(info["std"])[~varying] == 1.0).all()
    assert abs(secure.final_accuracy - plain.final_accuracy) < 0.05

    # the export takes raw pixels: its accuracy on the raw held-out rows is the run's own
    export_run(store, plain.run_id, tmp_path / "export")
    model = load_model(tmp_path / "export")
    test = task.server_data()  # raw pixels: the run standardised its own copy only
    assert test is not None and test.x.max() > 200
    with torch.no_grad():
        predicted = model(torch.from_numpy(test.x)).argmax(dim=1).numpy()
    assert float((predicted == test.y).mean()) == pytest.approx(plain.final_accuracy, abs=1e-9)
