"""Server-rendered pages: runs, a run, a round, clients, a client, the API reference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from core.status import ClientStatus, RunStatus
from dashboard.access import ScopedReader, may_download, principal_of
from dashboard.api import MAX_INT, RoundPath
from dashboard.privacy import run_hides_clients, without_private_runs
from dashboard.queries import Reader
from dashboard.views import (
    client_result_data,
    client_result_display,
    client_summary_data,
    edge_display,
    fmt_metric,
    fmt_num,
    fmt_time,
    round_data,
    round_display,
    run_data,
    run_display,
    scenario_text,
    secagg_table,
    tree_edges,
    tree_summary,
)

if TYPE_CHECKING:
    from fastapi.templating import Jinja2Templates

__all__ = ["router", "STATUSES"]

router = APIRouter(include_in_schema=False)
STATUSES = tuple(RunStatus)
PER_PAGE = 50


def _render(request: Request, template: str, **context: Any) -> HTMLResponse:
    templates: Jinja2Templates = request.app.state.templates  # set by dashboard.app.create_app
    return templates.TemplateResponse(request, template, context)


def _reader(request: Request) -> Reader:
    reader: Reader = request.app.state.reader  # set by dashboard.app.create_app
    return ScopedReader(reader, principal_of(request))  # type: ignore[return-value]  # per-client rows: its org's


def _run_or_404(reader: Reader, run_id: str) -> tuple[dict[str, Any], dict[str, str], Any]:
    found = reader.run(run_id)
    if found is None:
        raise HTTPException(status_code=404, detail=f"There is no run {run_id!r} in this store.")
    data = run_data(*found)
    return data, run_display(data), found[0]


@router.get("/", response_class=HTMLResponse)
def runs_page(request: Request, status: Annotated[str | None, Query()] = None,
               page: Annotated[int, Query(ge=1, le=MAX_INT)] = 1,
               per_page: Annotated[int, Query(ge=1, le=500)] = PER_PAGE) -> HTMLResponse:
    reader = _reader(request)
    since = reader.last_update()  # before the rows: a change while they are read is streamed again
    counts = reader.status_counts()
    total = sum(counts.values())
    matching = counts.get(status, 0) if status else total
    pages = max(1, -(-matching // per_page))
    page = min(page, pages)
    rows = [run_data(run, stats) for run, stats in reader.runs(status or None, per_page, (page - 1) * per_page)]
    metrics = {d["metric"]["name"] for d in rows}
    pager = {"page": page, "pages": pages, "per_page": per_page, "matching": matching,
             "first": (page - 1) * per_page + 1 if rows else 0, "last": (page - 1) * per_page + len(rows)}
    return _render(request, "runs.html", nav="runs", status=status or "", statuses=STATUSES, counts=counts,
                   total=total, runs=[(d, run_display(d)) for d in rows], since=since, pager=pager,
                   default_per_page=PER_PAGE, shared_metric=metrics.pop() if len(metrics) == 1 else "")


@router.get("/runs")
def runs_alias() -> Response:
    return RedirectResponse("/", status_code=308)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str) -> HTMLResponse:
    reader = _reader(request)
    run, display, row = _run_or_404(reader, run_id)
    rounds = [round_data(r) for r in reader.rounds(run_id)]
    metric = run["metric"]["name"]
    return _render(
        request, "run.html", nav="runs", run=run, display=display, rounds=rounds, metric=metric,
        round_rows=[(r, round_display(r, metric)) for r in reversed(rounds)],
        has_dp=any(r["epsilon"] is not None for r in rounds),
        has_secagg=any(r["secagg"] for r in rounds), scenario=scenario_text(row.scenario or {}),
        description=(row.scenario or {}).get("description", ""), info=row.info or {},
        events=reader.events(run_id),
        has_checkpoint=may_download(principal_of(request), row.info) and reader.store.has_checkpoint(run_id),
        chart_data={"run": run, "rounds": [_without_tree(r) for r in rounds]})


def _without_tree(round_: dict[str, Any]) -> dict[str, Any]:
    """Return a round's data for the run page's charts: without its edges' rows, which no chart draws."""
    return {k: v for k, v in round_.items() if k != "tree"}


@router.get("/runs/{run_id}/rounds/{number}", response_class=HTMLResponse)
def round_page(request: Request, run_id: str, number: RoundPath) -> HTMLResponse:
    reader = _reader(request)
    run, display, stored = _run_or_404(reader, run_id)
    row = reader.round(run_id, number)
    if row is None:
        raise HTTPException(status_code=404, detail=f"Run {run_id} has no committed round {number}.")
    data = round_data(row)
    metric = run["metric"]["name"]
    clients = [client_result_data(c) for c in reader.round_clients(run_id, number)]
    outcomes: dict[str, int] = {}
    for c in clients:
        outcomes[c["outcome"]] = outcomes.get(c["outcome"], 0) + 1
    sgd_eps = [float(e) for c in clients if isinstance(e := c["metrics"].get("dp-sgd-epsilon"), (int, float))]
    hidden = run_hides_clients(reader, run_id)
    if hidden:  # DP: counts only, never which clients were sampled
        clients = []
    columns, secagg_rows = secagg_table(data["secagg"]) if data["secagg"] else ([], [])
    has_tree = row.tree is not None  # [hierarchy]: the edges' table, and each device's edge
    edges = [(e, edge_display(e)) for e in tree_edges(row.tree)]
    score_names = sorted({k for values in data["scores"].values() for k in values}, key=lambda k: (k != metric, k))
    return _render(request, "round.html", nav="runs", run=run, run_display=display, round=data, metric=metric,
                   score_names=score_names, fmt_metric=fmt_metric,
                   display=round_display(data, metric),
                   clients=[(c, client_result_display(c, metric, edge_column=has_tree)) for c in clients],
                   has_tree=has_tree, edges=edges, tree=tree_summary(row.tree) if has_tree else {},
                   outcomes=outcomes, secagg_columns=columns, secagg_rows=secagg_rows, clients_hidden=hidden,
                   names=device_names(stored),
                   dp_sgd_epsilon=fmt_num(max(sgd_eps), 3) if sgd_eps else None,
                   has_prev=number > 1, has_next=number < run["rounds_done"],
                   has_checkpoint=may_download(principal_of(request), stored.info)
                   and reader.store.has_checkpoint(run_id, number))


def device_names(stored: Any) -> dict[str, str]:
    """Node id -> device name of a deployed run (its enrolment registry, recorded when the run opened)."""
    devices = (getattr(stored, "info", None) or {}).get("devices")
    if not isinstance(devices, dict):
        return {}
    return {str(k): str(v)[:64] for k, v in devices.items()}


def all_device_names(stored: Any) -> dict[str, str]:
    """Node id -> device name over every deployed run (newest last, so a renamed device shows its new name).

    Node ids are the SuperLink's, one per enrolled key, stable across runs.
    """
    names: dict[str, str] = {}
    for run in sorted(stored, key=lambda r: getattr(r, "started_at", 0) or 0):
        names.update(device_names(run))
    return names


#: Clients per page of /clients.
CLIENTS_PER_PAGE = 100


@router.get("/clients", response_class=HTMLResponse)
def clients_page(request: Request, run: Annotated[str | None, Query()] = None,
                 page: Annotated[int, Query(ge=1, le=MAX_INT // CLIENTS_PER_PAGE)] = 1) -> HTMLResponse:
    reader = _reader(request)
    hidden = bool(run and run_hides_clients(reader, run))
    total = 0 if hidden else reader.count_clients(run or None, public=not run)
    pages = max(1, -(-total // CLIENTS_PER_PAGE))
    page = min(page, pages)
    offset = (page - 1) * CLIENTS_PER_PAGE
    summaries = [] if hidden or not total else reader.clients(run or None, CLIENTS_PER_PAGE, offset, public=not run)
    clients = [client_summary_data(c) for c in summaries]
    stored = [r for r, _ in reader.runs()]
    runs = [(r.id, r.name) for r in stored]
    pager = {"page": page, "pages": pages, "matching": total, "first": offset + 1 if clients else 0,
             "last": offset + len(clients)}
    return _render(request, "clients.html", nav="clients", clients=clients, runs=runs, run=run or "",
                   fmt_time=fmt_time, pager=pager, devices=all_device_names(stored))


@router.get("/clients/{client}", response_class=HTMLResponse)
def client_page(request: Request, client: str, run: Annotated[str | None, Query()] = None) -> HTMLResponse:
    reader = _reader(request)
    rows = [client_result_data(c) for c in without_private_runs(reader, reader.client_history(client, run or None))]
    if not rows:
        raise HTTPException(status_code=404, detail=f"Client {client!r} has not taken part in any round.")
    names = reader.run_names([r["run_id"] for r in rows])
    metrics = {run_id: reader.headline(run_id).name for run_id in names}
    ok = sum(1 for r in rows if r["outcome"] == ClientStatus.OK)
    device = all_device_names(r for r, _ in reader.runs()).get(client)
    return _render(request, "client.html", nav="clients", client=client, names=names, run=run or "", device=device,
                   rows=[(r, client_result_display(r, metrics.get(r["run_id"], "accuracy"))) for r in rows], ok=ok,
                   last_seen=fmt_time(max(r["finished_at"] for r in rows)))


@router.get("/docs", response_class=HTMLResponse)
def api_reference(request: Request) -> HTMLResponse:
    schema = request.app.openapi()
    endpoints = [(method.upper(), path, op.get("summary", ""), op.get("description", ""),
                  [p["name"] for p in op.get("parameters", []) if p.get("in") == "query"])
                 for path, ops in schema["paths"].items() for method, op in ops.items()]
    return _render(request, "docs.html", nav="docs", endpoints=endpoints, title=schema["info"]["title"])
