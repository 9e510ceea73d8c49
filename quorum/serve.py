"""``quorum serve DIR``: batched predictions from an exported model over HTTP (FastAPI).

``POST /predict`` takes ``{"inputs": [example, ...]}``, each example of the
export's declared input shape (nested lists, or flattened to its size), at
most ``max_batch`` of them, and answers ``{"predictions": [...]}`` plus
``probabilities`` (class outputs) or ``outputs`` (raw values, e.g. a
regression). Anything else is refused before the model runs: a shape that
does not fit (422, naming the expected shape), a batch too large or a body
too large (413), non-finite values or a body that is not JSON (422).
``GET /`` describes the model; ``GET /health`` answers ``ok``. The server
binds loopback unless told otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from quorum.export import ExportedModel, load_export

__all__ = ["create_app", "Predictor", "DEFAULT_MAX_BATCH", "DEFAULT_MAX_BODY_BYTES"]

DEFAULT_MAX_BATCH = 256
DEFAULT_MAX_BODY_BYTES = 16 * 2**20


class Predictor:
    """Validates a batch against the export's declared input shape and runs the model on it."""

    def __init__(self, exported: ExportedModel, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.exported, self.max_batch = exported, max_batch
        self.shape = exported.input_shape
        self.size = math.prod(self.shape)

    def batch(self, payload: Any) -> np.ndarray:
        """The payload's ``inputs`` as one float32 array of shape ``(n, *input_shape)``.

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
        expected = f"each example must have shape {list(self.shape)} (or be a flat list of {self.size} numbers)"
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
        array = self.batch(payload)
        with torch.inference_mode():
            outputs = self.exported.module(torch.from_numpy(array)).float()
        if self.exported.classes is not None:
            probabilities = torch.softmax(outputs.reshape(len(array), -1), dim=1)
            return {"predictions": probabilities.argmax(dim=1).tolist(), "probabilities": probabilities.tolist()}
        values = outputs.reshape(len(array), -1)
        predictions = values[:, 0].tolist() if values.shape[1] == 1 else values.tolist()
        return {"predictions": predictions, "outputs": values.tolist()}


def create_app(directory: str | Path, *, max_batch: int = DEFAULT_MAX_BATCH,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The prediction service of the export in ``directory`` (loaded once, here).

    Raises
    ------
    ExportError
        The export cannot be loaded (see :func:`quorum.export.load_export`).
    """
    exported = load_export(directory)
    predictor = Predictor(exported, max_batch)
    app = FastAPI(title="Quorum model server", docs_url=None, redoc_url=None, openapi_url=None)
    manifest = exported.manifest
    info = {"run": manifest.get("run"), "task": manifest.get("task"), "input_shape": list(predictor.shape),
            "output": manifest.get("output"), "max_batch": max_batch}

    @app.get("/")
    def describe() -> dict[str, Any]:
        return info

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/predict")
    async def predict(request: Request) -> dict[str, Any]:
        return await run_in_threadpool(predictor, await _payload(request, max_body_bytes))

    return app


async def _payload(request: Request, limit: int) -> Any:
    """The request's JSON body: 415 if it is not JSON, 413 as soon as it passes ``limit`` bytes, 422 if unparsable."""
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
