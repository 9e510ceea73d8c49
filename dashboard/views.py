"""Rows of the store as plain data (for the API and live events) and as display text.

Each ``*_data`` function returns JSON-ready raw values; each ``*_display``
returns the strings a page shows for them. Pages and live updates both use
the display strings, so a row added by the live stream reads exactly like
one the server rendered.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from core.headline import ACCURACY, Headline, round_scores
from core.status import ClientStatus, RunStatus
from dashboard.queries import ClientSummary, RunStats
from runstore.report import client_scores
from runstore.store import EDGE_METRIC, ClientResult, Round, Run

__all__ = ["run_data", "run_display", "round_data", "round_display", "client_result_data",
           "client_result_display", "client_summary_data", "outcome_text", "scenario_text",
           "secagg_table", "tree_edges", "tree_summary", "edge_display", "json_safe", "EDGE_COUNTS", "EDGE_BYTES",
           "MAX_EDGES", "fmt_time", "fmt_duration", "fmt_bytes", "fmt_pct", "fmt_num", "fmt_metric",
           "ROUND_CSV_FIELDS", "round_csv_fields", "round_csv_row"]

DASH = "\u2014"
ROUND_CSV_FIELDS = ("round", "started_at", "duration_s", "sampled", "answered", "dropped", "rejected", "failed",
                    "train_loss", "fed_loss", "fed_accuracy", "server_loss", "server_accuracy",
                    "bytes_in", "bytes_out", "epsilon")
#: The most edges of one round a page or ``/metrics`` shows (the rest are counted, not listed).
MAX_EDGES = 1000
#: An edge row's device counts (``rounds.tree``), in the order the edges' table shows them.
EDGE_COUNTS = ("sampled", "answered", "dropped", "rejected", "failed", "refused")
#: An edge row's traffic: (direction, key): its instruction, its partial sum, what its devices sent it.
EDGE_BYTES = (("down", "bytes_down"), ("up", "bytes_up"), ("devices", "bytes_devices"))
_MAX_COUNT = 2**53  # beyond it a count is not exact as a float (Prometheus): not a count any edge sends
_MAX_SECONDS = 1e9
_MAX_TEXT = 500
_MAX_DEPTH = 32
# Client metrics that already have a column of their own.
_SHOWN_METRICS = {"num-examples", "train-loss", "duration-s", "eval-loss", "eval-accuracy"}


# -- formatting -----------------------------------------------------------
def fmt_time(ts: float | None) -> str:
    """Format a Unix time as local ``YYYY-MM-DD HH:MM:SS`` (a dash for None)."""
    return DASH if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt_duration(seconds: float | None) -> str:
    """Format seconds as ``12.3 s``, ``4 min 05 s`` or ``2 h 07 min`` (a dash for None or not finite)."""
    if seconds is None or not math.isfinite(seconds):
        return DASH
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def fmt_bytes(n: int | None) -> str:
    """Format a byte count in decimal units: ``512 B``, ``1.5 kB``, ``3.2 MB``, ``1.0 GB`` (a dash for None)."""
    if n is None:
        return DASH
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return DASH  # unreachable: the loop returns at GB


def fmt_pct(x: float | None) -> str:
    """Format a fraction as a percentage with one decimal (a dash for None or not finite)."""
    return DASH if x is None or not math.isfinite(x) else f"{x:.1%}"


def fmt_num(x: float | None, digits: int = 4) -> str:
    """Format a number with ``digits`` decimals (a dash for None; ``nan`` and ``inf`` as such)."""
    if x is None:
        return DASH
    return f"{x:.{digits}f}" if math.isfinite(x) else str(x)


def fmt_metric(name: str, x: float | None) -> str:
    """Format a task's score: ``accuracy`` as a percentage, any other to four significant digits."""
    if name == "accuracy":
        return fmt_pct(x)
    return DASH if x is None or not math.isfinite(x) else f"{x:.4g}"


def _clean(x: float | None) -> float | None:
    """NaN and infinities are not JSON; send them as null."""
    return x if x is None or math.isfinite(x) else None


# -- runs -----------------------------------------------------------------
def run_data(run: Run, stats: RunStats, now: float | None = None) -> dict[str, Any]:
    """``last_seen``: when the run's process last renewed its lease (an ``interrupted`` run ended there)."""
    end = run.finished_at or ((now or time.time()) if run.status == RunStatus.RUNNING
                              else max(run.updated_at, run.heartbeat_at or 0.0))
    headline = Headline.from_info(run.info)
    best = stats.metric_high if headline.higher_is_better else stats.metric_low
    return {
        "id": run.id, "name": run.name, "status": run.status, "strategy": run.strategy,
        "engine": run.engine, "seed": run.seed, "rounds_total": run.rounds_total,
        "rounds_done": run.rounds_done, "num_params": run.num_params,
        "best_accuracy": _clean(stats.best_accuracy), "last_accuracy": _clean(stats.last_accuracy),
        "epsilon": _clean(stats.epsilon), "bytes_in": stats.bytes_in, "bytes_out": stats.bytes_out,
        "started_at": run.started_at, "updated_at": run.updated_at, "finished_at": run.finished_at,
        "duration_s": max(0.0, end - run.started_at), "error": run.error, "last_seen": run.heartbeat_at,
        "metric": headline.to_json(), "best_metric": _clean(best), "last_metric": _clean(stats.last_metric),
    }


def run_display(d: Mapping[str, Any]) -> dict[str, str]:
    """Return the display strings of a run, from its :func:`run_data`."""
    return {
        "status": d["status"].replace("_", " "), "rounds": f"{d['rounds_done']} / {d['rounds_total']}",
        "best_accuracy": fmt_pct(d["best_accuracy"]), "last_accuracy": fmt_pct(d["last_accuracy"]),
        "epsilon": fmt_num(d["epsilon"], 3), "started_at": fmt_time(d["started_at"]),
        "finished_at": fmt_time(d["finished_at"]), "duration": fmt_duration(d["duration_s"]),
        "traffic": fmt_bytes(d["bytes_in"] + d["bytes_out"]), "params": f"{d['num_params']:,}",
        "last_seen": fmt_time(d["last_seen"]), **_metric_display(d),
    }


def _metric_display(d: Mapping[str, Any]) -> dict[str, str]:
    """Return the run's headline metric: its name, best and last value, and the best with its name (a mixed list)."""
    name = (d.get("metric") or ACCURACY.to_json())["name"]
    best, last = fmt_metric(name, d.get("best_metric")), fmt_metric(name, d.get("last_metric"))
    return {"metric": name, "best_metric": best, "last_metric": last,
            "best_metric_named": _named(name, best), "last_metric_named": _named(name, last)}


def _named(name: str, shown: str) -> str:
    """``c_index 0.7123`` (a list that mixes tasks names each value), or the dash alone."""
    return shown if shown == DASH else f"{name} {shown}"


# -- rounds ---------------------------------------------------------------
def round_data(r: Round) -> dict[str, Any]:
    """Return a round as JSON-ready values; ``accuracy`` is the server's, else the federated one."""
    accuracy = r.server_accuracy if r.server_accuracy is not None else r.fed_accuracy
    return {
        "round": r.round, "started_at": r.started_at, "duration_s": r.duration_s,
        "sampled": r.sampled, "answered": r.answered, "dropped": r.dropped, "rejected": r.rejected,
        "failed": r.failed or 0, "refused": _refused(r.metrics),
        "train_loss": _clean(r.train_loss), "fed_loss": _clean(r.fed_loss),
        "fed_accuracy": _clean(r.fed_accuracy), "server_loss": _clean(r.server_loss),
        "server_accuracy": _clean(r.server_accuracy), "accuracy": _clean(accuracy),
        "bytes_in": r.bytes_in, "bytes_out": r.bytes_out, "epsilon": _clean(r.epsilon),
        "secagg": json_safe(r.secagg) if isinstance(r.secagg, Mapping) else None,
        "tree": json_safe(r.tree) if isinstance(r.tree, Mapping) else None,
        "metrics": r.metrics or {},
        "metric": _clean(r.headline), "scores": round_scores(r),
    }


def _refused(metrics: Mapping[str, Any] | None) -> int:
    """Return the round's clients that their site policy refused (the store keeps the count in the metrics)."""
    n = (metrics or {}).get("refused", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def round_display(d: Mapping[str, Any], metric: str = "accuracy") -> dict[str, str]:
    """Return the display strings of a round, from its :func:`round_data`.

    ``metric`` names the run's headline (shown as ``metric``, ``server_metric``
    and ``fed_metric``) and ``task_metrics`` lists the task's other scores, by split.
    """
    scores = d.get("scores") or {}
    return {
        "metric": fmt_metric(metric, d.get("metric")),
        "server_metric": fmt_metric(metric, scores.get("server", {}).get(metric)),
        "fed_metric": fmt_metric(metric, scores.get("federated", {}).get(metric)),
        "task_metrics": _others(scores, metric),
        "round": str(d["round"]), "started_at": fmt_time(d["started_at"]),
        "duration": fmt_duration(d["duration_s"]),
        "clients": f"{d['answered']} / {d['sampled']}", "sampled": str(d["sampled"]),
        "answered": str(d["answered"]), "dropped": str(d["dropped"]), "rejected": str(d["rejected"]),
        "failed": str(d["failed"]), "refused": str(d.get("refused", 0)),
        "accuracy": fmt_pct(d["accuracy"]), "server_accuracy": fmt_pct(d["server_accuracy"]),
        "fed_accuracy": fmt_pct(d["fed_accuracy"]), "train_loss": fmt_num(d["train_loss"]),
        "fed_loss": fmt_num(d["fed_loss"]), "server_loss": fmt_num(d["server_loss"]),
        "bytes_in": fmt_bytes(d["bytes_in"]), "bytes_out": fmt_bytes(d["bytes_out"]),
        "epsilon": fmt_num(d["epsilon"], 3),
    }


def _others(scores: Mapping[str, Mapping[str, float]], metric: str) -> str:
    """Format the task's scores besides its headline and loss: ``fed mae 1.234, fed r2 0.45``."""
    shown = [f"{_SHORT_SPLIT[split]} {k} {fmt_metric(k, v)}" for split, values in scores.items()
             for k, v in sorted(values.items()) if k not in (metric, "loss")]
    return ", ".join(shown) or DASH


_SHORT_SPLIT = {"server": "server", "federated": "fed"}


def round_csv_fields(rounds: Sequence[Mapping[str, Any]], metric: str) -> list[str]:
    """Return the metrics CSV's columns.

    They are :data:`ROUND_CSV_FIELDS`, the headline metric under its own name
    (its server value, else the federated one), then each task score the
    rounds recorded (``fed-c_index``, ``server-mae``).
    """
    named = sorted({f"{_SHORT_SPLIT[split]}-{k}" for d in rounds for split, values in (d.get("scores") or {}).items()
                    for k in values if k not in ("accuracy", "loss")})
    return [*ROUND_CSV_FIELDS, _headline_column(metric), *named]


def round_csv_row(d: Mapping[str, Any], metric: str) -> dict[str, Any]:
    """One round of the metrics CSV (:func:`round_csv_fields`)."""
    named = {f"{_SHORT_SPLIT[split]}-{k}": v for split, values in (d.get("scores") or {}).items()
             for k, v in values.items()}
    return {**d, **named, _headline_column(metric): d.get("metric")}


def _headline_column(metric: str) -> str:
    return f"metric-{metric}" if metric in ROUND_CSV_FIELDS else metric


# -- clients --------------------------------------------------------------
def outcome_text(outcome: str, stage: str | None, reason: str | None) -> str:
    """One line for a client's part in a round: "ok", "dropped at train", ..."""
    if outcome == ClientStatus.OK:
        return "ok"
    if outcome == ClientStatus.REFUSED:  # the device's own site policy: the reason is its rule
        text = "refused by its site policy" + (f" at {stage}" if stage else "")
        return f"{text}: {reason}" if reason else text
    text = outcome if not stage else f"{outcome} at {stage}"
    return f"{text}: {reason}" if reason else text


def client_result_data(c: ClientResult) -> dict[str, Any]:
    """Return a client's result in a round as JSON-ready values, with its outcome as one line of text."""
    return {
        "run_id": c.run_id, "round": c.round, "client": c.client, "outcome": c.outcome,
        "stage": c.stage, "reason": c.reason, "description": outcome_text(c.outcome, c.stage, c.reason),
        "num_examples": c.num_examples, "train_loss": _clean(c.train_loss),
        "eval_loss": _clean(c.eval_loss), "eval_accuracy": _clean(c.eval_accuracy),
        "duration_s": c.duration_s, "bytes_in": c.bytes_in, "bytes_out": c.bytes_out or 0, "metrics": c.metrics or {},
        "eval_metrics": client_scores(c), "finished_at": c.finished_at,
    }


def client_result_display(d: Mapping[str, Any], metric: str = "accuracy", edge_column: bool = False
                          ) -> dict[str, str]:
    """Display strings of a client's result; ``metric`` (the run's headline) is its own score of it.

    ``edge``: the edge aggregator the device was under (a tree's round), a dash
    for none; with ``edge_column`` it has a column of its own, so it is left
    out of ``metrics``.
    """
    shown = _SHOWN_METRICS | {EDGE_METRIC} if edge_column else _SHOWN_METRICS
    extra = {k: v for k, v in d["metrics"].items() if k not in shown}
    edge = _count(d["metrics"].get(EDGE_METRIC))
    return {
        "edge": DASH if edge is None else str(edge),
        "metric": fmt_metric(metric, (d.get("eval_metrics") or {}).get(metric)),
        "metric_named": _named(metric, fmt_metric(metric, (d.get("eval_metrics") or {}).get(metric))),
        "examples": f"{d['num_examples']:,}" if d["num_examples"] else DASH,
        "train_loss": fmt_num(d["train_loss"]), "eval_loss": fmt_num(d["eval_loss"]),
        "eval_accuracy": fmt_pct(d["eval_accuracy"]), "duration": fmt_duration(d["duration_s"]),
        "bytes_in": fmt_bytes(d["bytes_in"]) if d["bytes_in"] else DASH,
        "bytes_out": fmt_bytes(d["bytes_out"]) if d.get("bytes_out") else DASH,
        "metrics": ", ".join(f"{k}={_short(v)}" for k, v in sorted(extra.items())) or DASH,
        "finished_at": fmt_time(d["finished_at"]),
        "robust": robust_mark(d["metrics"]),
    }


def robust_mark(metrics: Mapping[str, Any]) -> str:
    """Describe what a robust aggregator did to this client's update ("" when nothing): core.buffer marks."""
    marks = []
    if metrics.get("clipped"):
        marks.append("clipped")
    if metrics.get("rejected"):
        marks.append("rejected by the rule")
    trimmed = metrics.get("trimmed")
    if isinstance(trimmed, (int, float)) and not isinstance(trimmed, bool) and 0 < trimmed <= 1:
        marks.append(f"trimmed {trimmed:.0%}")
    return ", ".join(marks)


def client_summary_data(c: ClientSummary) -> dict[str, Any]:
    """Return a client's totals as JSON-ready values, with its last run and round and recent participations."""
    last = c.recent[0] if c.recent else None
    return {
        "client": c.client, "rounds": c.rounds, "ok": c.ok, "dropped": c.dropped, "rejected": c.rejected,
        "failed": c.failed,
        "runs": c.runs, "examples": c.examples, "last_seen": c.last_seen,
        "last_run": last.run_id if last else None, "last_round": last.round if last else None,
        "recent": [{"run_id": p.run_id, "round": p.round, "outcome": p.outcome,
                    "description": outcome_text(p.outcome, p.stage, p.reason)} for p in c.recent],
    }


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# -- scenario and secure aggregation --------------------------------------
def scenario_text(scenario: Mapping[str, Any]) -> str:
    """Render the scenario as TOML-like text: top-level keys, then one ``[table]`` per section."""
    lines = [_toml_line(k, v) for k, v in scenario.items() if not isinstance(v, Mapping)]
    lines.extend(_toml_tables(scenario, prefix=""))
    return "\n".join(lines).strip() + "\n"


def _toml_tables(table: Mapping[str, Any], prefix: str) -> list[str]:
    lines: list[str] = []
    for key, value in table.items():
        if not isinstance(value, Mapping):
            continue
        name = f"{prefix}{key}"
        scalars = {k: v for k, v in value.items() if not isinstance(v, Mapping)}
        lines.extend(["", f"[{name}]", *(_toml_line(k, v) for k, v in scalars.items())])
        lines.extend(_toml_tables(value, prefix=f"{name}."))
    return lines


def _toml_line(key: str, value: Any) -> str:
    if value is None:
        return f"# {key} is not set"
    if isinstance(value, bool):
        return f"{key} = {'true' if value else 'false'}"
    return f"{key} = {json.dumps(value)}"


def secagg_table(secagg: Any) -> tuple[list[str], list[list[str]]]:
    """Columns and rows for whatever the secure-aggregation workflow recorded.

    A ``{"stages": [{...}, ...]}`` dict becomes one row per stage with the union
    of the stages' keys as columns; any other dict becomes key / value rows.
    """
    if not isinstance(secagg, Mapping):
        return ["value"], [[_cell(secagg)]]
    stages = secagg.get("stages")
    if isinstance(stages, Sequence) and stages and all(isinstance(s, Mapping) for s in stages):
        columns: list[str] = []
        for stage in stages:
            columns.extend(k for k in stage if k not in columns)
        return columns, [[_cell(stage.get(c)) for c in columns] for stage in stages]
    return ["key", "value"], [[str(k), _cell(v)] for k, v in secagg.items()]


def _cell(value: Any) -> str:
    if value is None:
        return DASH
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (Mapping, list, tuple)):
        return json.dumps(value, sort_keys=True)
    return str(value)


# -- edge aggregators ([hierarchy]) ---------------------------------------
def json_safe(value: Any, depth: int = 0) -> Any:
    """Return stored JSON as JSON a response may carry: non-finite numbers and what nests too deep become null."""
    if depth > _MAX_DEPTH:
        return None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): json_safe(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v, depth + 1) for v in value]
    return value if value is None or isinstance(value, (str, int)) else str(value)


def _count(value: Any) -> int | None:
    """Return a count or byte figure as stored: a non-negative int (not a bool) below 2**53, else None."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_COUNT
    return value if ok else None


def _seconds(value: Any) -> float | None:
    """Return a duration (or another non-negative figure) as stored if finite, non-negative, below 1e9, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value < _MAX_SECONDS else None  # NaN fails both comparisons


def _text(value: Any) -> str | None:
    """Return a reason as stored, as one line of at most 500 characters (another JSON value as its JSON)."""
    if value is None:
        return None
    text = " ".join((value if isinstance(value, str) else _cell(value)).split())
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT - 1] + "\u2026"


def tree_edges(tree: Any) -> list[dict[str, Any]]:
    """Return a round's edge rows (``rounds.tree["edges"]``), each read defensively.

    Every row has ``edge`` (its number), ``name`` (a deployed edge's), the :data:`EDGE_COUNTS`, ``seconds``,
    the byte figures of :data:`EDGE_BYTES` and ``problem`` (why its devices
    were lost): the stored value when it has the right type and range, else
    None; and ``first``, whether it is the first row with its edge number (a
    row without one never is). A row that is not an object is skipped; at most
    :data:`MAX_EDGES`.
    """
    edges = tree.get("edges") if isinstance(tree, Mapping) else None
    if not isinstance(edges, Sequence) or isinstance(edges, (str, bytes)):
        return []
    rows = []
    seen: set[int] = set()
    for stored in edges:
        if not isinstance(stored, Mapping):
            continue
        edge = _count(stored.get("edge"))
        row: dict[str, Any] = {"edge": edge, "first": edge is not None and edge not in seen}
        if edge is not None:
            seen.add(edge)
        row.update({key: _count(stored.get(key)) for key in EDGE_COUNTS})
        row["seconds"] = _seconds(stored.get("seconds"))
        row.update({key: _count(stored.get(key)) for _, key in EDGE_BYTES})
        row["problem"] = _text(stored.get("problem"))
        row["name"] = _text(stored.get("name"))  # a deployed edge's enrolled name
        rows.append(row)
        if len(rows) == MAX_EDGES:
            break
    return rows


def edge_display(row: Mapping[str, Any]) -> dict[str, str]:
    """Return the display strings of one :func:`tree_edges` row (a dash for what was not recorded)."""
    shown = {key: DASH if row[key] is None else f"{row[key]:,}" for key in EDGE_COUNTS}
    shown["edge"] = DASH if row["edge"] is None else str(row["edge"])
    shown["name"] = row.get("name") or ""
    shown.update({key: fmt_bytes(row[key]) for _, key in EDGE_BYTES})
    seconds = row["seconds"]  # an edge's sub-round often takes well under a second: two decimals below ten
    took = fmt_duration(seconds) if seconds is None or seconds >= 10 else f"{seconds:.2f} s"
    return {**shown, "seconds": took, "problem": row["problem"] or ""}


def tree_summary(tree: Any) -> dict[str, str]:
    """Return the display strings of a round's tree besides its edge rows.

    ``edges``: how many edge rows it holds; ``cut``: a note when the table
    lists only the first :data:`MAX_EDGES` of them; ``seconds``: how long the edges'
    sub-rounds took in all; ``bytes_devices``: what the devices sent their
    edges; ``secure``: one line on the secure sum across the edges ("" when
    the round had none).
    """
    tree = tree if isinstance(tree, Mapping) else {}
    edges = tree.get("edges")
    listed = edges if isinstance(edges, Sequence) and not isinstance(edges, (str, bytes)) else []
    count = sum(1 for e in listed if isinstance(e, Mapping))
    cut = f"The first {MAX_EDGES:,} of {count:,} edges are listed." if count > MAX_EDGES else ""
    return {"edges": f"{count:,}", "cut": cut, "seconds": fmt_duration(_seconds(tree.get("seconds"))),
            "bytes_devices": fmt_bytes(_count(tree.get("bytes_devices"))),
            "secure": _secure_line(tree.get("secure_across_edges"))}


def _secure_line(secure: Any) -> str:
    """Return one line on the secure sum across the edges: who survived it, or why it was aborted or refused."""
    if secure is None:
        return ""
    if not isinstance(secure, Mapping):
        return f"secure sum across the edges: {_text(secure)}"
    edges = _count(secure.get("edges"))
    across = f"secure sum across {DASH if edges is None else edges} edges"
    for outcome in ("aborted", "refused"):
        if secure.get(outcome) is not None:
            return f"{across} {outcome}: {_text(secure.get(outcome))}"
    survivors = _count(secure.get("survivors"))
    bound = _seconds(secure.get("error_bound"))  # a finite, non-negative figure, as a duration is
    bound_text = DASH if bound is None else f"{bound:.3g}"
    return (f"{across}: {DASH if survivors is None else survivors} survived, error bound {bound_text}, "
            f"{fmt_bytes(_count(secure.get('bytes_up')))} up, {fmt_bytes(_count(secure.get('bytes_down')))} down")
