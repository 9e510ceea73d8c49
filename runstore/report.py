"""Run reports: PNG plots per round and per client and a JSON summary, from the run store.

The task's headline metric (``core.headline``: ``accuracy``, ``c_index``,
``mae``, ...) comes first: its own panel beside the loss, and against the bytes
moved. Every numeric round metric a run recorded (a task's ``server-mae`` /
``fed-c_index``, a robust rule's counts, DP figures) is summarised and charted,
and each client's own scores (``eval-<name>``) are written to ``clients.csv``
and the headline's plotted per client, so a task that defines its own metrics
gets them reported without a line of report code.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.headline import Headline, round_scores, round_value
from runstore.store import ClientResult, Round, RunStore

__all__ = ["write_report", "run_summary", "numeric_metrics", "headline_summary", "client_scores"]

#: Clients drawn one line each in ``clients_<metric>.png`` (all of them are in ``clients.csv``).
MAX_PLOTTED_CLIENTS = 50


def numeric_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """Return the numbers among a round's metrics (``status``, ``reason`` and flags left out)."""
    return {k: float(v) for k, v in (metrics or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def run_summary(store: RunStore, run_id: str) -> dict[str, Any]:
    """Everything about a run that fits in one JSON object."""
    run = store.get_run(run_id)
    rounds = store.rounds(run.id)
    headline = Headline.from_info(run.info)
    accuracies = [r.server_accuracy if r.server_accuracy is not None else r.fed_accuracy for r in rounds]
    known = [a for a in accuracies if a is not None]
    return {
        "run_id": run.id, "scenario": run.name, "status": run.status, "strategy": run.strategy,
        "seed": run.seed, "rounds_total": run.rounds_total, "rounds_done": len(rounds),
        "metric": headline_summary(headline, rounds),
        "final_accuracy": accuracies[-1] if accuracies else None,
        "best_accuracy": max(known) if known else None,
        "final_train_loss": rounds[-1].train_loss if rounds else None,
        "epsilon": rounds[-1].epsilon if rounds else None,
        "duration_s": (run.finished_at or run.updated_at) - run.started_at,
        "uplink_bytes": sum(r.bytes_in for r in rounds), "downlink_bytes": sum(r.bytes_out for r in rounds),
        "compression": (run.scenario or {}).get("compression"),
        "rounds": [{
            "round": r.round, "train_loss": r.train_loss, "fed_loss": r.fed_loss,
            "fed_accuracy": r.fed_accuracy, "server_loss": r.server_loss,
            "server_accuracy": r.server_accuracy, "sampled": r.sampled, "answered": r.answered,
            "dropped": r.dropped, "rejected": r.rejected, "failed": r.failed or 0, "duration_s": r.duration_s,
            "bytes_in": r.bytes_in, "bytes_out": r.bytes_out,
            "epsilon": r.epsilon, "metric": round_value(headline, r)[0], "scores": round_scores(r),
            "metrics": numeric_metrics(r.metrics)} for r in rounds],
        "final_metrics": numeric_metrics(rounds[-1].metrics) if rounds else {},
        "final_scores": round_scores(rounds[-1]) if rounds else {},
    }


def headline_summary(headline: Headline, rounds: Sequence[Round]) -> dict[str, Any]:
    """Summarise the run's headline metric.

    Its name and direction, its value after the last round that scored it
    (``final``, and the ``split`` it came from: ``server`` or ``federated``)
    and its ``best`` over the rounds.
    """
    values = [round_value(headline, r) for r in rounds]
    scored = [(v, split) for v, split in values if v is not None]
    final, split = scored[-1] if scored else (None, None)
    return {**headline.to_json(), "final": final, "split": split, "best": headline.best(v for v, _ in scored)}


def client_scores(result: ClientResult) -> dict[str, float]:
    """Return one client's own scores of the global model in one round, in the task's names.

    ``loss``, ``accuracy``, ``c_index``, ...: its columns and its
    ``eval-<name>`` metrics (``eval-examples``, its weight, left out).
    """
    named: dict[str, Any] = {"loss": result.eval_loss, "accuracy": result.eval_accuracy}
    named.update({k.removeprefix("eval-"): v for k, v in (result.metrics or {}).items()
                  if k.startswith("eval-") and k != "eval-examples"})
    return {k: float(v) for k, v in named.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def write_report(store: RunStore, run_id: str, out_dir: str | Path) -> list[Path]:
    """Write the report of a run into ``out_dir``; returns the files written.

    ``summary.json``; ``<metric>_loss.png``, the task's headline metric (server
    and federated) beside the losses (``accuracy_loss.png`` for a classifier,
    ``c_index_loss.png`` for a survival model); ``clients.png``;
    ``<metric>_bytes.png``, the headline against cumulative bytes on the wire;
    ``metrics.png`` when the rounds recorded numeric metrics of their own (one
    panel per metric); and when clients scored the model on their own test
    splits, ``clients.csv`` (every client's scores, per round) and
    ``clients_<metric>.png`` (the headline per client, per round).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = run_summary(store, run_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, title, metric = summary["rounds"], summary["scenario"], summary["metric"]["name"]
    slug = _slug(metric)
    paths = [out / "summary.json", out / f"{slug}_loss.png", out / "clients.png", out / f"{slug}_bytes.png"]
    paths[0].write_text(json.dumps(summary, indent=2))
    _plot_headline_loss(plt, title, metric, rows, paths[1])
    _plot_clients(plt, rows, paths[2])
    _plot_bytes(plt, title, metric, rows, paths[3])
    names = sorted({k for r in rows for k in r["metrics"]})
    if names:
        paths.append(out / "metrics.png")
        _plot_metrics(plt, title, rows, names, paths[-1])
    return paths + _client_report(plt, store, summary["run_id"], metric, out)


def _slug(name: str) -> str:
    """Make a metric name fit for a file name (``c_index``, ``accuracy``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "metric"


def _plot_clients(plt: Any, rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["round"] for r in rows]
    for key in ("sampled", "answered", "dropped", "rejected", "failed"):
        ax.plot(x, [r[key] for r in rows], marker="o", label=key)
    ax.set(title="clients per round", xlabel="round", ylabel="clients")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_headline_loss(plt: Any, title: str, metric: str, rows: list[dict[str, Any]], path: Path) -> None:
    """Plot the headline metric (server, federated) and the loss (train, server, federated) per round, side by side."""
    fig, (ax_metric, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["round"] for r in rows]
    for split in ("server", "federated"):
        values = [r["scores"].get(split, {}).get(metric) for r in rows]
        if any(v is not None for v in values):
            ax_metric.plot(x, values, marker="o", label=split)
    for key, label in (("train_loss", "train"), ("server_loss", "server"), ("fed_loss", "federated")):
        if any(r[key] is not None for r in rows):
            ax_loss.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax_metric.set(title=f"{title}: {metric}", xlabel="round", ylabel=metric)
    ax_loss.set(title="loss", xlabel="round", ylabel="loss")
    for ax in (ax_metric, ax_loss):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    _save(plt, fig, path)


def _client_report(plt: Any, store: RunStore, run_id: str, metric: str, out: Path) -> list[Path]:
    """``clients.csv`` and ``clients_<metric>.png`` from the clients' own scores (none: no file)."""
    from sqlalchemy import select

    with store.session() as s:
        results = list(s.scalars(select(ClientResult).where(ClientResult.run_id == run_id)
                                 .order_by(ClientResult.round, ClientResult.id)))
    scored = [(r, client_scores(r)) for r in results]
    scored = [(r, scores) for r, scores in scored if scores]
    if not scored:
        return []
    names = sorted({k for _, scores in scored for k in scores}, key=lambda k: (k != metric, k))
    table = out / "clients.csv"
    with table.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["round", "client", "eval_examples", *names])
        for r, scores in scored:
            writer.writerow([r.round, r.client, (r.metrics or {}).get("eval-examples", ""),
                             *(scores.get(k, "") for k in names)])
    paths = [table]
    if any(metric in scores for _, scores in scored):
        paths.append(out / f"clients_{_slug(metric)}.png")
        _plot_per_client(plt, metric, scored, paths[-1])
    return paths


def _plot_per_client(plt: Any, metric: str, scored: list[tuple[ClientResult, dict[str, float]]],
                     path: Path) -> None:
    """One line per client (the first :data:`MAX_PLOTTED_CLIENTS`): its own ``metric`` on its test split."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r, scores in scored:
        if metric in scores:
            series.setdefault(r.client, []).append((r.round, scores[metric]))
    shown = sorted(series, key=lambda c: (0, int(c), "") if c.isdigit() else (1, 0, c))[:MAX_PLOTTED_CLIENTS]
    fig, ax = plt.subplots(figsize=(7, 4))
    for client in shown:
        ax.plot(*zip(*series[client], strict=True), marker="o", label=f"client {client}")
    more = f" (first {len(shown)} of {len(series)})" if len(series) > len(shown) else ""
    ax.set(title=f"{metric} per client, on its own test split{more}", xlabel="round", ylabel=metric)
    ax.grid(alpha=0.3)
    if len(shown) <= 12:
        ax.legend(fontsize="small")
    _save(plt, fig, path)


def _plot_bytes(plt: Any, title: str, metric: str, rows: list[dict[str, Any]], path: Path) -> None:
    """Plot the headline metric (server's, else federated) against cumulative uplink and total bytes on the wire."""
    up = both = 0
    ups, boths = [], []
    for r in rows:
        up += r["bytes_in"]
        both += r["bytes_in"] + r["bytes_out"]
        ups.append(up / 1e6)
        boths.append(both / 1e6)
    values = [r["metric"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ups, values, marker="o", label="against uplink bytes")
    ax.plot(boths, values, marker=".", linestyle=":", label="against total bytes")
    ax.set(title=f"{title}: {metric} against bytes moved", xlabel="cumulative MB on the wire", ylabel=metric)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(plt, fig, path)


def _plot_metrics(plt: Any, title: str, rows: list[dict[str, Any]], names: list[str], path: Path) -> None:
    """One small panel per round metric, rounds on the x axis (a gap where a round lacks it)."""
    cols = min(3, len(names))
    fig, axes = plt.subplots(-(-len(names) // cols), cols, figsize=(4 * cols, 3 * -(-len(names) // cols)),
                             squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        ax.plot([r["round"] for r in rows], [r["metrics"].get(name) for r in rows], marker="o")
        ax.set(title=name, xlabel="round")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: round metrics")
    _save(plt, fig, path)
