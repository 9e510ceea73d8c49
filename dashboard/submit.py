"""Remote run submission: ``POST /api/runs``, ``/api/runs/{run_id}/stop`` and ``/resume``, and their outcome.

The dashboard never reaches the SuperLink: a request that passes its checks
is queued in the run store (``runstore/submissions.py``) and answered 202 with
the submission's id; the aggregator that leads the federation takes it from
there (``deploy/submissions.py``) and ``GET /api/submissions/{submission}``
says how it went. Who may call these routes is :data:`dashboard.access.WRITES`
(an ``admin`` or a ``lead``; the guard records a refused role in the audit
trail); a lead stops and resumes only the runs it submitted. Every request that
reaches a handler is recorded here, allowed or not.

The body is JSON of at most :data:`MAX_BODY` bytes: ``{"scenario": ...}``, the
scenario as TOML text or as a JSON object, validated with the scenario loader
before it is queued (422 naming the key), and optionally ``"federation"``.
"""

from __future__ import annotations

import json
import tomllib
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from core.errors import QuorumError
from dashboard.access import principal_of, record
from dashboard.queries import Reader
from runstore.accounts import Principal
from runstore.audit import RESUME, STOP, SUBMIT
from runstore.submissions import FAILED, enqueue, finish, get
from scenarios.errors import ScenarioError
from scenarios.schema import loads_scenario, scenario_from_dict

__all__ = ["router", "MAX_BODY"]

router = APIRouter(prefix="/api", tags=["submissions"])
#: The most a submission's body may hold: the shipped scenarios are a few KiB.
MAX_BODY = 256 * 1024
_FEDERATION_CHARS = 64
_QUEUED: dict[int | str, dict[str, Any]] = {
    202: {"description": "Queued for the leading aggregator: `{\"submission\": ID, \"status\": \"pending\"}`."},
    403: {"description": "Not an admin or a lead; a lead's stop or resume of a run it did not submit; a "
                         "cookie session without `X-Requested-With: quorum`."},
    429: {"description": "Too many changes by this account: wait a few seconds."},
    503: {"description": "The run store or the audit trail did not take the request."}}
SUBMIT_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_QUEUED, 400: {"description": "The body is not JSON text in UTF-8."},
    413: {"description": f"The body is larger than {MAX_BODY // 1024} KiB."},
    415: {"description": "The body is not `application/json`."},
    422: {"description": "A bad scenario (the message names the key), or a body without one."}}
RUN_RESPONSES: dict[int | str, dict[str, Any]] = {**_QUEUED, 404: {"description": "No such run."}}
#: ``POST /api/runs``'s body, documented by hand: the handler reads it itself, to cap its size before parsing.
SUBMIT_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["scenario"], "properties": {
        "scenario": {"oneOf": [{"type": "string", "description": "The scenario file's TOML text."},
                               {"type": "object", "description": "The scenario as a JSON object."}]},
        "federation": {"type": "string", "maxLength": _FEDERATION_CHARS,
                       "description": "Only this federation's aggregator may take it."}}}}}}}


def _reader(request: Request) -> Reader:
    reader: Reader = request.app.state.reader  # set by dashboard.app.create_app
    return reader


def _refuse(request: Request, action: str, status: int, why: str, target: str = "") -> HTTPException:
    """Record a refused attempt in the audit trail; return the error to raise."""
    record(_reader(request).store, action, principal_of(request), target=target[:255], allowed=False,
           status=status, reason=why[:500])
    return HTTPException(status_code=status, detail=why)


async def _body(request: Request) -> dict[str, Any]:
    """Read the JSON body, at most :data:`MAX_BODY` bytes; 415, 413 or 400 otherwise."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise _refuse(request, SUBMIT, 415, "the body must be JSON (Content-Type: application/json)")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise _refuse(request, SUBMIT, 413, f"the body is larger than {MAX_BODY // 1024} KiB, the most a "
                          "submission may hold")
    try:
        body = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _refuse(request, SUBMIT, 400, "the body is not JSON text in UTF-8") from None
    if not isinstance(body, dict):
        raise _refuse(request, SUBMIT, 422, "the body must be a JSON object: {\"scenario\": ...}")
    return body


def _scenario(request: Request, value: Any) -> dict[str, Any]:
    """Validate the submitted scenario (TOML text or an object); return it as plain data, or 422 naming the key."""
    try:
        if isinstance(value, str):
            scenario = loads_scenario(value, source="submission")
        elif isinstance(value, dict):
            scenario = scenario_from_dict(value, source="submission")
        else:
            raise ScenarioError("submission: \"scenario\" must be the scenario's TOML text or a JSON object")
        if scenario.task.entry and _task_path(value):
            raise ScenarioError("submission: [task] path names a folder on the aggregator's host: a remote "
                                "submission may only name an installed task")
        spec = scenario.to_dict()
        spec["task"] = {**spec.get("task", {}), "path": "", "source": ""}  # placed by the aggregator, not here
        json.dumps(spec, allow_nan=False)
    except (ScenarioError, TypeError, ValueError, RecursionError) as exc:
        raise _refuse(request, SUBMIT, 422, str(exc).splitlines()[0][:500] if str(exc) else "a bad scenario") \
            from None
    return spec


def _task_path(value: Any) -> bool:
    """Whether the submitted scenario names a ``[task] path`` (TOML text is parsed by the loader already)."""
    if isinstance(value, str):
        value = tomllib.loads(value)  # parsed once by the loader already: cannot fail here
    task = value.get("task") if isinstance(value, dict) else None
    return isinstance(task, dict) and bool(task.get("path"))


def _federation(request: Request, body: dict[str, Any]) -> str | None:
    value = body.get("federation")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= _FEDERATION_CHARS:
        raise _refuse(request, SUBMIT, 422, f"\"federation\" must be a federation's name, 1-{_FEDERATION_CHARS} "
                      "characters")
    return value


def _queued(request: Request, action: str, who: Principal, target: str = "", **queue: Any) -> JSONResponse:
    """Queue the request and record it; 503 when the store takes neither (what is not recorded is not done)."""
    store = _reader(request).store
    try:
        submission = enqueue(store, who.name, who.org, action, **queue)
    except (QuorumError, SQLAlchemyError) as exc:
        raise HTTPException(status_code=503, detail=f"the run store did not take the request: {exc}"[:500]) \
            from None
    try:
        record(store, action, who, required=True, target=target[:255], allowed=True, submission=submission)
    except (QuorumError, SQLAlchemyError):
        finish(store, submission, False, error="the audit trail could not record it")
        raise HTTPException(status_code=503, detail="the audit trail could not record the request") from None
    return JSONResponse({"submission": submission, "status": "pending"}, status_code=202)


@router.post("/runs", status_code=202, summary="Submit a run (a scenario): queued for the leading aggregator",
             responses=SUBMIT_RESPONSES, openapi_extra=SUBMIT_BODY)
async def submit_run(request: Request) -> JSONResponse:
    body = await _body(request)
    if "scenario" not in body:
        raise _refuse(request, SUBMIT, 422, "the body names no \"scenario\"")
    spec = _scenario(request, body["scenario"])
    federation = _federation(request, body)
    return _queued(request, SUBMIT, principal_of(request), target=str(spec.get("name", "")),
                   federation=federation, scenario=spec)


def _own_run(request: Request, action: str, run_id: str) -> dict[str, Any]:
    """Return the run's info when the principal may stop or resume it (an admin, or the lead that submitted it)."""
    who = principal_of(request)
    found = _reader(request).run(run_id) if len(run_id) <= 64 else None
    if found is None:
        raise _refuse(request, action, 404, f"no run {run_id[:64]!r}", target=run_id)
    info: dict[str, Any] = found[0].info or {}
    if not who.is_admin and info.get("submitted_by") != who.name:
        raise _refuse(request, action, 403, f"forbidden: run {run_id!r} was not submitted by {who.name!r}",
                      target=run_id)
    return info


@router.post("/runs/{run_id}/stop", status_code=202, summary="Stop a run: queued for the leading aggregator",
             responses=RUN_RESPONSES)
def stop_run(request: Request, run_id: str) -> JSONResponse:
    info = _own_run(request, STOP, run_id)
    return _queued(request, STOP, principal_of(request), target=run_id, run_id=run_id,
                   federation=info.get("federation") or None)


@router.post("/runs/{run_id}/resume", status_code=202, summary="Resume a run: queued for the leading aggregator",
             responses=RUN_RESPONSES)
def resume_run(request: Request, run_id: str) -> JSONResponse:
    info = _own_run(request, RESUME, run_id)
    return _queued(request, RESUME, principal_of(request), target=run_id, run_id=run_id,
                   federation=info.get("federation") or None)


@router.get("/submissions/{submission}", summary="How a submission went: pending, taken, done or failed",
            responses={404: {"description": "No such submission of this account's (an admin sees all)."}})
def get_submission(request: Request, submission: str) -> dict[str, Any]:
    who = principal_of(request)
    number = int(submission) if submission.isascii() and submission.isdigit() and len(submission) < 12 else None
    found = get(_reader(request).store, number) if number is not None else None
    if found is None or not (who.is_admin or found.account == who.name):
        raise HTTPException(status_code=404, detail=f"no submission {submission[:20]!r} of yours")
    out = found.as_dict()
    out["finished"] = found.status in ("done", FAILED)
    return out
