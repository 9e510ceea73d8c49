"""Federated LoRA through the whole platform (issue 14), on a tiny Llama built in code (no download).

Adapters-only traffic, secure aggregation, DP, export in peft's layout, the
merged model and ``POST /generate``.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from learning.task import TaskModel, load_task
from quorum.cli import app
from quorum.errors import ExportError
from quorum.export import MANIFEST, export_run, load_export
from quorum.serve import create_app
from runstore.store import RunStore
from runtimes.simulation import simulate
from scenarios.schema import scenario_from_dict

pytestmark = pytest.mark.heavy  # its module fixture trains and exports a run

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

with warnings.catch_warnings():  # starlette's import-time deprecation (httpx2), not ours
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

TASK = {"entry": "learning.tasks.language:LanguageModelTask", "model": "tiny-llama", "min_lines": 200,
        "seq_len": 32, "steps": 4, "eval_rows": 8}
ADAPTER_VALUES = 3584  # 2 layers x (q: 8x64 + 64x8, v: 8x64 + 32x8): see tests/learning/test_language.py


def lm_raw(**sections: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "lm-fed", "seed": 5, "rounds": 3, "task": dict(TASK),
        "federation": {"clients": 3, "min_clients": 3, "deadline_s": 120.0},
        "training": {"batch_size": 4, "lr": 0.01}, "evaluation": {"federated": False}}
    raw.update(sections)
    return raw


def run(tmp: Path, **sections: Any) -> tuple[RunStore, str]:
    db = f"sqlite:///{tmp / 'runs.db'}"
    summary = simulate(scenario_from_dict(lm_raw(**sections), source="lm"), db_url=db, workers=1)
    assert summary.status == "finished", summary
    return RunStore(db), summary.run_id


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunStore, str]:
    return run(tmp_path_factory.mktemp("plain"))


def full_model_bytes() -> int:
    model = load_task(scenario_from_dict(lm_raw(), source="lm")).build_model(5)
    return 4 * sum(p.numel() for p in model.parameters())


def test_perplexity_falls_round_by_round_and_only_adapters_travel(plain: tuple[RunStore, str]) -> None:
    store, run_id = plain
    rounds = store.rounds(run_id)
    perplexities = [r.metrics["server-perplexity"] for r in rounds]
    assert len(perplexities) == 3 and perplexities[-1] < perplexities[0]
    assert all(p == pytest.approx(math.exp(r.server_loss), rel=1e-6) for p, r in zip(perplexities, rounds, strict=True))
    state = store.load_state(run_id, None)
    assert state is not None and state.params.size == ADAPTER_VALUES
    for r in rounds:  # three float32 adapter vectors each way, plus Flower's framing; the base never moves
        assert 3 * ADAPTER_VALUES * 4 <= r.bytes_in < 3 * ADAPTER_VALUES * 4 * 1.5
        assert r.bytes_out < 0.1 * 3 * full_model_bytes()


def test_eight_bit_adapters_a_quarter_of_the_bytes(tmp_path: Path, plain: tuple[RunStore, str]) -> None:
    store, run_id = run(tmp_path, compression={"bits": 8})
    rounds, plain_rounds = store.rounds(run_id), plain[0].rounds(plain[1])
    assert 3 * ADAPTER_VALUES <= rounds[0].bytes_in < 0.35 * plain_rounds[0].bytes_in
    # stochastic rounding is unbiased: the model learns as the float32 run does
    assert rounds[-1].server_loss == pytest.approx(plain_rounds[-1].server_loss, abs=0.05)
    assert rounds[-1].server_loss < plain_rounds[0].server_loss


def test_adapters_under_secure_aggregation_and_distributed_dp(tmp_path: Path, plain: tuple[RunStore, str]) -> None:
    store, run_id = run(tmp_path, secagg={"enabled": True, "bits": 16},
                        dp={"enabled": True, "placement": "distributed", "clip_norm": 5.0, "noise_multiplier": 0.01})
    rounds, plain_rounds = store.rounds(run_id), plain[0].rounds(plain[1])
    assert all(r.answered == 3 and r.secagg for r in rounds)
    assert rounds[-1].epsilon is not None and rounds[-1].epsilon > 0
    assert rounds[-1].server_loss == pytest.approx(plain_rounds[-1].server_loss, abs=0.05)
    assert rounds[-1].server_loss < plain_rounds[0].server_loss


@pytest.fixture(scope="module")
def exported(plain: tuple[RunStore, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run exported by the CLI, with the merged model."""
    store, run_id = plain
    out = tmp_path_factory.mktemp("export") / "adapters"
    db = store.engine.url.render_as_string(hide_password=False)
    done = CliRunner().invoke(app, ["export", run_id, "--out", str(out), "--merged", "--db", db])  # in-process
    assert done.exit_code == 0, done.output
    assert "adapter_model.safetensors" in done.output.replace("\n", "")  # rich wraps long paths
    return out


def test_export_writes_adapters_that_peft_reads_and_a_merged_model(exported: Path,
                                                                   plain: tuple[RunStore, str]) -> None:
    manifest = json.loads((exported / MANIFEST).read_text())
    assert manifest["output"] == {"kind": "text"} and manifest["weights"] == "adapter_model.safetensors"
    assert sum(math.prod(s) for s in manifest["tensors"].values()) == ADAPTER_VALUES
    assert (exported / "adapter_config.json").is_file()
    config = json.loads((exported / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    ours = load_export(exported)
    store, run_id = plain
    state = store.load_state(run_id, None)
    assert state is not None
    np.testing.assert_array_equal(TaskModel(ours.task, ours.module, tuple(ours.task.trainable(ours.module)))  # type: ignore[arg-type]
                                  .get_flat(), state.params)
    task = ours.task
    base = task.build_base(5)  # the same frozen base, from the run's seed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs = peft.PeftModel.from_pretrained(base, str(exported)).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(exported / "merged")).eval()
    ids = torch.tensor([list(b"To be, or not to be")])
    with torch.inference_mode():
        expected = ours.module(input_ids=ids).logits
        torch.testing.assert_close(theirs(input_ids=ids).logits, expected)
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_adapters_of_another_shape_are_refused(exported: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("adapter_config.json", MANIFEST):
        (copy / name).write_bytes((exported / name).read_bytes())
    from safetensors.torch import save_file
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
              str(copy / "adapter_model.safetensors"))
    manifest = json.loads((copy / MANIFEST).read_text())
    from quorum.export import _sha256
    manifest["sha256"] = _sha256(copy / "adapter_model.safetensors")
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="adapters do not fit"):
        load_export(copy)


def test_adapters_for_another_base_are_refused(exported: Path, tmp_path: Path) -> None:
    copy = tmp_path / "other-base"
    copy.mkdir()
    for path in exported.iterdir():
        if path.is_file():
            (copy / path.name).write_bytes(path.read_bytes())
    manifest = json.loads((copy / MANIFEST).read_text())
    assert manifest["base"] == {"model": "tiny-llama", "sha256": ""}
    manifest["base"] = {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "sha256": "ab" * 32}
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="trained on base"):
        load_export(copy)


def test_merged_needs_adapters(tmp_path: Path) -> None:
    from tests.conftest import tiny_scenario
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    summary = simulate(tiny_scenario(rounds=1), db_url=db, workers=1)
    with pytest.raises(ExportError, match="--merged folds LoRA adapters"):
        export_run(RunStore(db), summary.run_id, tmp_path / "out", merged=True)


@pytest.fixture(scope="module")
def client(exported: Path) -> TestClient:
    return TestClient(create_app(exported))


def test_generate_continues_a_prompt_greedily_and_repeatably(client: TestClient) -> None:
    body = {"prompt": "ROMEO:", "max_new_tokens": 12}
    first, again = client.post("/generate", json=body), client.post("/generate", json=body)
    assert first.status_code == 200, first.text
    assert first.json() == again.json() and first.json()["tokens"] == 12 and first.json()["prompt_tokens"] == 6
    sampled = {**body, "temperature": 1.5, "seed": 7}
    assert client.post("/generate", json=sampled).json() == client.post("/generate", json=sampled).json()
    assert client.post("/predict", json={"inputs": [[0]]}).status_code in (404, 405)
    assert client.get("/").json()["output"] == {"kind": "text"}


@pytest.mark.parametrize(("body", "reason"), [
    ({"prompt": ""}, "prompt must be"),
    ({"prompt": "x" * 8001}, "prompt must be"),
    ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens = 0"),
    ({"prompt": "x", "max_new_tokens": True}, "max_new_tokens = True"),
    ({"prompt": "x", "temperature": 9}, "temperature = 9"),
    ({"prompt": "x", "temperature": 1e-300}, "0 (greedy) or at least 0.01"),
    ({"prompt": "x", "top_p": 0.5}, "unknown key 'top_p'"),
    (["x"], "expected a JSON object"),
])
def test_generate_refuses_bad_requests_naming_the_key(client: TestClient, body: Any, reason: str) -> None:
    answer = client.post("/generate", json=body)
    assert answer.status_code == 422 and reason in answer.json()["detail"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["prompt", "max_new_tokens", "temperature", "seed", "other"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.text(max_size=20),
                                 st.floats(allow_nan=False, allow_infinity=False), st.lists(st.integers(), max_size=3)),
                       max_size=4))
def test_generate_answers_any_body_without_a_server_error(client: TestClient, body: dict[str, Any]) -> None:
    if isinstance(body.get("max_new_tokens"), int) and not isinstance(body["max_new_tokens"], bool):
        body["max_new_tokens"] = min(body["max_new_tokens"], 4)  # keep the valid ones quick
    answer = client.post("/generate", json=body)
    assert answer.status_code in (200, 422), answer.text


def test_the_dashboard_shows_perplexity_per_round(plain: tuple[RunStore, str]) -> None:
    from dashboard.app import create_app as dashboard_app
    store, run_id = plain
    dashboard = TestClient(dashboard_app(store.engine.url.render_as_string(hide_password=False)),
                           base_url="http://127.0.0.1")
    rounds = dashboard.get(f"/api/runs/{run_id}/rounds").json()
    assert [r["metrics"]["server-perplexity"] for r in rounds] == \
        [r.metrics["server-perplexity"] for r in store.rounds(run_id)]
    page = dashboard.get(f"/runs/{run_id}")
    assert page.status_code == 200 and 'id="panel-metrics"' in page.text
