"""The JSON API under ``/api/``, live streams, downloads and ``/metrics``."""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Path, Query, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from sqlalchemy.exc import SQLAlchemyError
from starlette.background import BackgroundTask

from core.errors import QuorumError, StoreError
from core.headline import Headline
from dashboard.access import ScopedReader, may_download, principal_of, record
from dashboard.live import run_events, runs_events
from dashboard.metrics import CONTENT_TYPE, render_metrics
from dashboard.privacy import HIDDEN_DETAIL, public_clients, run_hides_clients, without_private_runs
from dashboard.queries import Reader
from dashboard.schemas import ClientResultOut, ClientSummaryOut, EventOut, RoundOut, RunDetailOut, RunOut
from dashboard.views import (
    client_result_data,
    client_summary_data,
    round_csv_fields,
    round_csv_row,
    round_data,
    run_data,
)
from runstore.audit import DOWNLOAD_CHECKPOINT

__all__ = ["router", "metrics_router", "MAX_INT", "RoundPath"]

router = APIRouter(prefix="/api", tags=["api"])
metrics_router = APIRouter(tags=["metrics"])

StatusQuery = Annotated[str | None, Query(description="Only runs with this status.")]
RunQuery = Annotated[str | None, Query(alias="run", description="Only this run.")]
#: The largest number a query or path may carry: beyond it SQLite cannot bind it (a 4xx, never a 500).
MAX_INT = 2**63 - 1
RoundPath = Annotated[int, Path(ge=0, le=MAX_INT, description="The round number.")]
#: The most clients one request of ``/api/clients`` may ask for (page through the rest with ``offset``).
MAX_CLIENTS_PAGE = 1000


#: Error answers, declared in /openapi.json so every status a route can give is documented.
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "No such run, round, client or checkpoint."}}
HIDDEN: dict[int | str, dict[str, Any]] = {403: {"description": "The run keeps its participants private."}}
NOT_YOURS: dict[int | str, dict[str, Any]] = {
    403: {"description": "Only an admin, or the lead that submitted the run, downloads its model."}}
DAMAGED: dict[int | str, dict[str, Any]] = {
    409: {"description": "The checkpoint is damaged or is not a regular file: refused, never served; the detail "
                         "says why in one line."}}


def reader_of(request: Request) -> Reader:
    """Return the store's reader, showing per-client rows of the request's organisation only (``dashboard.access``)."""
    reader: Reader = request.app.state.reader  # set by dashboard.app.create_app
    return ScopedReader(reader, principal_of(request))  # type: ignore[return-value]  # a Reader in all but name


def _found(value: Any, what: str) -> Any:
    if value is None:
        raise HTTPException(status_code=404, detail=f"no {what}")
    return value


@router.get("/runs", response_model=list[RunOut], summary="Every run, newest first")
def list_runs(request: Request, status: StatusQuery = None,
              limit: Annotated[int | None, Query(ge=1, le=10_000, description="At most this many runs.")] = None,
              offset: Annotated[int, Query(ge=0, le=MAX_INT, description="Skip this many of the newest runs first.")]
              = 0,
              ) -> list[dict[str, Any]]:
    return [run_data(run, stats) for run, stats in reader_of(request).runs(status, limit, offset)]


@router.get("/runs/{run_id}", response_model=RunDetailOut, summary="One run, with its scenario",
            responses=NOT_FOUND)
def get_run(request: Request, run_id: str) -> dict[str, Any]:
    run, stats = _found(reader_of(request).run(run_id), f"run {run_id!r}")
    return {**run_data(run, stats), "scenario": run.scenario, "info": run.info or {}}


@router.get("/runs/{run_id}/rounds", response_model=list[RoundOut], summary="A run's committed rounds",
            responses=NOT_FOUND)
def list_rounds(request: Request, run_id: str,
                after: Annotated[int, Query(ge=0, le=MAX_INT, description="Only rounds after this one.")] = 0
                ) -> list[dict[str, Any]]:
    reader = reader_of(request)
    _found(reader.head(run_id), f"run {run_id!r}")
    return [round_data(r) for r in reader.rounds(run_id, after)]


@router.get("/runs/{run_id}/rounds/{number}", response_model=RoundOut, summary="One round", responses=NOT_FOUND)
def get_round(request: Request, run_id: str, number: RoundPath) -> dict[str, Any]:
    return round_data(_found(reader_of(request).round(run_id, number), f"round {number} in run {run_id!r}"))


@router.get("/runs/{run_id}/rounds/{number}/clients", response_model=list[ClientResultOut],
            summary="Each sampled client's outcome in one round", responses={**NOT_FOUND, **HIDDEN})
def round_clients(request: Request, run_id: str, number: RoundPath) -> list[dict[str, Any]]:
    reader = reader_of(request)
    _found(reader.round(run_id, number), f"round {number} in run {run_id!r}")
    if run_hides_clients(reader, run_id):
        raise HTTPException(status_code=403, detail=HIDDEN_DETAIL)
    return [client_result_data(c) for c in reader.round_clients(run_id, number)]


@router.get("/runs/{run_id}/log", response_model=list[EventOut], summary="A run's event log (last 200)")
def run_log(request: Request, run_id: str) -> list[dict[str, Any]]:
    return [{"ts": e.ts, "level": e.level, "message": e.message} for e in reader_of(request).events(run_id)]


@router.get("/runs/{run_id}/events", response_class=EventSourceResponse,
            summary="Live: new rounds of a run as Server-Sent Events")
async def run_stream(request: Request, run_id: str,
                     after: Annotated[int, Query(ge=0, le=MAX_INT, description="Send rounds after this one.")] = 0,
                     last_event_id: Annotated[str | None, Header()] = None) -> AsyncIterator[ServerSentEvent]:
    """Stream a run's new rounds and status changes as Server-Sent Events; the stream ends when the run does.

    `round` events (data: `{"round": Round, "display": {...}}`, id: the round number) and
    `run` events (data: `{"run": Run, "display": {...}}`).
    """
    if last_event_id and last_event_id.isdigit():
        after = max(after, min(int(last_event_id), MAX_INT))
    async for event in run_events(reader_of(request), run_id, after):
        yield event


@router.get("/events", response_class=EventSourceResponse, summary="Live: changes to any run")
async def all_runs_stream(request: Request,
                          since: Annotated[float | None, Query(description="Unix time of the last change seen.")]
                          = None) -> AsyncIterator[ServerSentEvent]:
    """Stream changes to any run as Server-Sent Events.

    A `run` event (data: `{"run": Run, "display": {...}}`) whenever a run starts, commits a
    round or changes status; after each batch of them a `counts` event (data: `{"counts":
    {status: runs}, "total": runs}`).
    """
    async for event in runs_events(reader_of(request), since):
        yield event


@router.get("/runs/{run_id}/metrics.csv", summary="A run's per-round metrics as CSV",
            response_class=Response, responses={200: {"content": {"text/csv": {}}}, **NOT_FOUND})
def rounds_csv(request: Request, run_id: str) -> Response:
    """Download a run's per-round metrics as CSV, one row per round.

    Columns: the round's figures, the task's headline metric under its own name (`c_index`: the
    server's score, else the clients'), then every task score by split (`fed-c_index`, `server-mae`, ...).
    """
    reader = reader_of(request)
    run, _ = _found(reader.run(run_id), f"run {run_id!r}")
    metric = Headline.from_info(run.info).name
    rounds = [round_data(r) for r in reader.rounds(run.id)]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=round_csv_fields(rounds, metric), extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows(round_csv_row(r, metric) for r in rounds)
    return Response(out.getvalue(), media_type="text/csv; charset=utf-8",
                    headers={"content-disposition": f'attachment; filename="{run.id}-rounds.csv"'})


@router.get("/runs/{run_id}/checkpoint", summary="A model checkpoint (safetensors; default the last round)",
            response_class=Response,
            responses={200: {"content": {"application/octet-stream": {}}}, **NOT_FOUND, **DAMAGED, **NOT_YOURS})
def checkpoint(request: Request, run_id: str,
               server_round: Annotated[int | None, Query(alias="round", ge=1, le=MAX_INT)] = None) -> Response:
    """Download a round's checkpoint, checked (its safetensors header and length) before the first byte is sent.

    Streamed from what was opened (a file opened without following a symbolic link, the database's chunks, an
    object); a damaged one, or one that is not a regular file, is a 409 naming why.
    """
    reader = reader_of(request)
    stored = reader.run(run_id)
    if stored is not None and not may_download(principal_of(request), stored[0].info):
        raise HTTPException(status_code=403, detail="forbidden: a model is downloaded by an admin or the lead "
                                                    "that submitted its run")
    try:
        found = reader.checkpoint(run_id, server_round)
    except StoreError as exc:
        raise HTTPException(status_code=409, detail=str(exc)) from None
    number, blob = _found(found, "checkpoint file for that round")
    try:  # who downloaded which model: recorded first, or not served
        record(reader.store, DOWNLOAD_CHECKPOINT, principal_of(request), required=True, target=run_id, round=number)
    except (QuorumError, SQLAlchemyError) as exc:
        blob.release()
        raise HTTPException(status_code=503, detail=f"the download could not be recorded in the audit trail "
                                                    f"({str(exc).splitlines()[0]}); not served") from None
    name = f"{run_id}-round-{number:05d}.safetensors"
    headers = {"content-disposition": f'attachment; filename="{name}"', "content-length": str(blob.size)}
    return StreamingResponse(blob.pieces, media_type="application/octet-stream", headers=headers,
                             background=BackgroundTask(blob.release))  # released even when the download stops


@router.get("/clients", response_model=list[ClientSummaryOut], summary="Every client's participation, one page")
def list_clients(request: Request, run_id: RunQuery = None,
                 limit: Annotated[int | None, Query(ge=1, le=MAX_CLIENTS_PAGE,
                                                    description="At most this many clients (natural order).")] = None,
                 offset: Annotated[int, Query(ge=0, le=MAX_INT, description="Skip this many clients first.")] = 0,
                 ) -> list[dict[str, Any]]:
    reader = reader_of(request)
    if run_id is None:  # summed over the runs that do not hide their participants (DP)
        return [client_summary_data(c) for c in public_clients(reader, limit, offset)]
    if run_hides_clients(reader, run_id):
        return []  # a DP run's participants stay hidden
    return [client_summary_data(c) for c in reader.clients(run_id, limit, offset)]


@router.get("/clients/{client}", response_model=list[ClientResultOut],
            summary="One client's history, newest first", responses=NOT_FOUND)
def client_history(request: Request, client: str, run_id: RunQuery = None) -> list[dict[str, Any]]:
    rows = without_private_runs(reader_of(request), reader_of(request).client_history(client, run_id))
    return [client_result_data(c) for c in _found(rows or None, f"client {client!r}")]


@metrics_router.get("/metrics", response_class=Response, summary="Prometheus metrics",
                    responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request) -> Response:
    return Response(render_metrics(request.app.state.registry), media_type=CONTENT_TYPE)
