"""``quorum serve DIR``: batched predictions from an exported model over HTTP (FastAPI).

``POST /predict`` takes ``{"inputs": [example, ...]}``, each example of the
export's declared input shape (nested lists, or flattened to its size), at
most ``max_batch`` of them, and answers ``{"predictions": [...]}`` plus
``probabilities`` (class outputs) or ``outputs`` (raw values, e.g. a
regression). When the task names its features (``feature_names``), an
example may also be an object of them, ``{"age": 52, "bmi": 31.2, ...}``,
every name once. Anything else is refused before the model runs: a shape that
does not fit (422, naming the expected shape), a missing or unknown feature
(422, naming it), a batch too large or a body too large (413), non-finite
values or a body that is not JSON (422). ``GET /`` describes the model (the
run, the task, the input shape and feature names, the output, the task's
headline metric); ``GET /health`` answers ``ok``. The server binds loopback
unless told otherwise.

A language-model export (LoRA adapters) answers ``POST /generate`` instead:
``{"prompt": "...", "max_new_tokens": 32, "temperature": 0.0, "seed": 0}``
(temperature 0 is greedy, else at least 0.01; the seed makes sampling repeatable) gives
``{"text": ..., "tokens": n, "prompt_tokens": m}``. Each key is checked
(type, range, a prompt of at most 8,000 characters and 2,048 tokens) and
named in the 422 when it is wrong; one generation runs at a time, and a
request that waits more than 30 s for the one before it gets a 503.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from quorum.errors import ExportError
from quorum.export import ExportedModel, load_export

__all__ = ["create_app", "Predictor", "Generator", "DEFAULT_MAX_BATCH", "DEFAULT_MAX_BODY_BYTES"]

DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_BODY_BYTES = 16 * 2**20
MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS, MAX_NEW_TOKENS = 8000, 2048, 512
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 5.0
BUSY_WAIT_S = 30.0  # how long a request waits for the generation before it; then 503


class Predictor:
    """Validates a batch against the export's declared input shape and runs the model on it."""

    def __init__(self, exported: ExportedModel, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.exported, self.max_batch = exported, max_batch
        self.shape = exported.input_shape
        self.size = math.prod(self.shape)
        features = exported.manifest.get("features")
        self.features: list[str] | None = list(features) if isinstance(features, list) else None

    def batch(self, payload: Any) -> np.ndarray:
        """Return the payload's ``inputs`` as one float32 array of shape ``(n, *input_shape)``.

        Raises
        ------
        HTTPException
            413 for more than ``max_batch`` examples; 422 for anything else that does not fit.
        """
        inputs = payload.get("inputs") if isinstance(payload, dict) else None
        if not isinstance(inputs, list) or not inputs:
            raise HTTPException(422, 'expected a JSON object {"inputs": [example, ...]} with at least one example')
        if len(inputs) > self.max_batch:
            raise HTTPException(413, f"{len(inputs)} examples: at most {self.max_batch} per request")
        expected = f"each example must have shape {list(self.shape)} (or be a flat list of {self.size} numbers" + \
            (", or an object of the features)" if self.features else ")")
        features = self.features
        if features is not None:
            inputs = [_by_name(x, features, self.shape) if isinstance(x, dict) else x for x in inputs]
        try:
            array = np.asarray(inputs, dtype=np.float32)
        except (ValueError, TypeError):
            raise HTTPException(422, f"inputs are not a rectangular batch of numbers: {expected}") from None
        if array.shape[1:] != self.shape:
            if array.ndim != 2 or array.shape[1] != self.size:
                raise HTTPException(422, f"inputs have shape {list(array.shape)}: {expected}")
            array = array.reshape((len(array), *self.shape))
        if not np.isfinite(array).all():
            raise HTTPException(422, "inputs hold NaN or infinite values")
        return array

    def __call__(self, payload: Any) -> dict[str, Any]:
        """Run the model on the payload's batch.

        Returns ``predictions`` (the argmax class) and ``probabilities`` for a
        classifier, else ``predictions`` and the raw ``outputs``.
        """
        array = self.batch(payload)
        with torch.inference_mode():
            outputs = self.exported.module(torch.from_numpy(array)).float()
        if self.exported.classes is not None:
            probabilities = torch.softmax(outputs.reshape(len(array), -1), dim=1)
            return {"predictions": probabilities.argmax(dim=1).tolist(), "probabilities": probabilities.tolist()}
        values = outputs.reshape(len(array), -1)
        predictions = values[:, 0].tolist() if values.shape[1] == 1 else values.tolist()
        return {"predictions": predictions, "outputs": values.tolist()}


def _by_name(example: dict[str, Any], features: list[str], shape: tuple[int, ...]) -> Any:
    """Return an example given as an object of the task's features as nested lists of ``shape``.

    Its values go in the features' order; a missing or unknown feature is a
    422 naming it.
    """
    missing = [name for name in features if name not in example]
    unknown = sorted(set(example) - set(features))
    if missing or unknown:
        which = f"missing feature {missing[0]!r}" if missing else f"unknown feature {unknown[0]!r}"
        raise HTTPException(422, f"{which}; the features are {', '.join(features)}")
    return np.asarray([example[name] for name in features], dtype=object).reshape(shape).tolist()


class Generator:
    """Validates a generation request and continues its prompt with the exported language model."""

    #: key -> (type, low, high, default)
    FIELDS: dict[str, tuple[type, float, float, Any]] = {
        "max_new_tokens": (int, 1, MAX_NEW_TOKENS, 32), "temperature": (float, 0.0, MAX_TEMPERATURE, 0.0),
        "seed": (int, 0, 2**63 - 1, 0)}

    def __init__(self, exported: ExportedModel) -> None:
        if exported.task is None or not hasattr(exported.task, "generate"):
            raise ExportError("the export's output is text, but its task cannot generate")
        self.exported = exported
        self.task: Any = exported.task  # a language-model task: tokenizer and generate
        self._lock = threading.Lock()

    def request(self, payload: Any) -> tuple[str, dict[str, Any]]:
        """Return the prompt and the checked settings; 422 naming a key missing, of a wrong type or out of range."""
        if not isinstance(payload, dict):
            raise HTTPException(422, 'expected a JSON object {"prompt": "...", "max_new_tokens": 32, ...}')
        unknown = sorted(set(payload) - {"prompt", *self.FIELDS})
        if unknown:
            raise HTTPException(422, f"unknown key {unknown[0]!r}; allowed: prompt, {', '.join(self.FIELDS)}")
        prompt = payload.get("prompt")
        if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
            raise HTTPException(422, f"prompt must be a non-empty string of at most {MAX_PROMPT_CHARS} characters")
        settings = {}
        for key, (kind, low, high, default) in self.FIELDS.items():
            value = payload.get(key, default)
            ok = not isinstance(value, bool) and isinstance(value, int if kind is int else (int, float))
            if not ok or not low <= value <= high:
                raise HTTPException(422, f"{key} = {value!r}: must be {kind.__name__} in [{low}, {high}]")
            settings[key] = kind(value)
        if 0 < settings["temperature"] < MIN_TEMPERATURE:  # logits / 1e-300 overflow: no distribution left
            raise HTTPException(422, f"temperature = {settings['temperature']!r}: 0 (greedy) or at least "
                                     f"{MIN_TEMPERATURE}")
        return prompt, settings

    def __call__(self, payload: Any) -> dict[str, Any]:
        """Continue the request's prompt; return the ``text``, its ``tokens`` and the ``prompt_tokens`` used.

        Raises
        ------
        HTTPException
            422 for a request :meth:`request` refuses, a prompt over
            :data:`MAX_PROMPT_TOKENS` tokens or a generation the model refused;
            503 when another generation held the model for over
            :data:`BUSY_WAIT_S` seconds.
        """
        prompt, settings = self.request(payload)
        used = len(self.task.tokenizer.encode(prompt))
        if used > MAX_PROMPT_TOKENS:
            raise HTTPException(422, f"prompt is {used} tokens: at most {MAX_PROMPT_TOKENS}")
        if not self._lock.acquire(timeout=BUSY_WAIT_S):  # one generation at a time: each uses every core
            raise HTTPException(503, f"busy: another generation has run for over {BUSY_WAIT_S:g} s; retry later")
        try:
            text, tokens = self.task.generate(self.exported.module, prompt, **settings)
        except RuntimeError as exc:  # the model itself refused (e.g. a sampling distribution that is not one)
            raise HTTPException(422, f"generation failed: {str(exc)[:200]}") from None
        finally:
            self._lock.release()
        return {"text": text, "tokens": tokens, "prompt_tokens": used}


def create_app(directory: str | Path, *, max_batch: int = DEFAULT_MAX_BATCH,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """Build the prediction service of the export in ``directory`` (loaded once, here).

    Raises
    ------
    ExportError
        The export cannot be loaded (see :func:`quorum.export.load_export`).
    """
    exported = load_export(directory)
    app = FastAPI(title="Quorum model server", docs_url=None, redoc_url=None, openapi_url=None)
    manifest = exported.manifest
    text = isinstance(manifest.get("output"), dict) and manifest["output"].get("kind") == "text"
    info = {"run": manifest.get("run"), "task": manifest.get("task"), "input_shape": list(exported.input_shape),
            "features": manifest.get("features"), "output": manifest.get("output"), "metric": manifest.get("metric"),
            "max_batch": max_batch}

    @app.get("/")
    async def describe() -> dict[str, Any]:  # async: answered even while every worker thread generates
        return info

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    if text:
        generator = Generator(exported)

        @app.post("/generate")
        async def generate(request: Request) -> dict[str, Any]:
            return await run_in_threadpool(generator, await _payload(request, max_body_bytes))
    else:
        predictor = Predictor(exported, max_batch)

        @app.post("/predict")
        async def predict(request: Request) -> dict[str, Any]:
            return await run_in_threadpool(predictor, await _payload(request, max_body_bytes))

    return app


async def _payload(request: Request, limit: int) -> Any:
    """Read the request's JSON body: 415 if not JSON, 413 as soon as it passes ``limit`` bytes, 422 if unparsable."""
    kind = request.headers.get("content-type", "application/json").split(";")[0].strip()
    if kind != "application/json":
        raise HTTPException(415, f"expected application/json, got {kind!r}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"request body of {declared} bytes: at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks) or b"null", parse_constant=_no_constant)
    except ValueError as exc:
        raise HTTPException(422, f"request body is not JSON: {exc}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")
