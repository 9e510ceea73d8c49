"""Run reports: PNG plots per round and a JSON summary, from the run store.

Besides accuracy and loss, every numeric round metric a run recorded (a
task's ``server-mae`` / ``server-r2``, a robust rule's counts, DP figures) is
summarised and charted, so a task that defines its own metrics gets them
plotted without a line of report code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from aggregator.store import RunStore

__all__ = ["write_report", "run_summary", "numeric_metrics"]


def numeric_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """The numbers among a round's metrics (``status``, ``reason`` and flags left out)."""
    return {k: float(v) for k, v in (metrics or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def run_summary(store: RunStore, run_id: str) -> dict[str, Any]:
    """Everything about a run that fits in one JSON object."""
    run = store.get_run(run_id)
    rounds = store.rounds(run.id)
    accuracies = [r.server_accuracy if r.server_accuracy is not None else r.fed_accuracy for r in rounds]
    known = [a for a in accuracies if a is not None]
    return {
        "run_id": run.id, "scenario": run.name, "status": run.status, "strategy": run.strategy,
        "seed": run.seed, "rounds_total": run.rounds_total, "rounds_done": len(rounds),
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
            "epsilon": r.epsilon, "metrics": numeric_metrics(r.metrics)} for r in rounds],
        "final_metrics": numeric_metrics(rounds[-1].metrics) if rounds else {},
    }


def write_report(store: RunStore, run_id: str, out_dir: str | Path) -> list[Path]:
    """Write ``summary.json``, ``accuracy_loss.png``, ``clients.png``, ``accuracy_bytes.png``
    (accuracy against cumulative bytes on the wire) and, when the rounds recorded numeric metrics
    of their own, ``metrics.png`` (one panel per metric) into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = run_summary(store, run_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summary["rounds"]
    x = [r["round"] for r in rows]
    paths = [out / "summary.json", out / "accuracy_loss.png", out / "clients.png"]
    paths[0].write_text(json.dumps(summary, indent=2))

    _plot_accuracy_loss(plt, summary["scenario"], rows, x, paths[1])

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("sampled", "answered", "dropped", "rejected", "failed"):
        ax.plot(x, [r[key] for r in rows], marker="o", label=key)
    ax.set(title="clients per round", xlabel="round", ylabel="clients")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)
    paths.append(out / "accuracy_bytes.png")
    _plot_bytes(plt, summary["scenario"], rows, paths[-1])
    names = sorted({k for r in rows for k in r["metrics"]})
    if names:
        paths.append(out / "metrics.png")
        _plot_metrics(plt, summary["scenario"], rows, names, paths[-1])
    return paths


def _plot_accuracy_loss(plt: Any, title: str, rows: list[dict[str, Any]], x: list[int], path: Path) -> None:
    """Accuracy (server, federated) and loss (train, server, federated) per round, side by side."""
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("server_accuracy", "server"), ("fed_accuracy", "federated")):
        ax_acc.plot(x, [r[key] for r in rows], marker="o", label=label)
    for key, label in (("train_loss", "train"), ("server_loss", "server"), ("fed_loss", "federated")):
        ax_loss.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax_acc.set(title=f"{title}: accuracy", xlabel="round", ylabel="accuracy")
    ax_loss.set(title="loss", xlabel="round", ylabel="loss")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_bytes(plt: Any, title: str, rows: list[dict[str, Any]], path: Path) -> None:
    """Accuracy (server's, else federated) against cumulative uplink and total bytes on the wire."""
    up = both = 0
    ups, boths, acc = [], [], []
    for r in rows:
        up += r["bytes_in"]
        both += r["bytes_in"] + r["bytes_out"]
        ups.append(up / 1e6)
        boths.append(both / 1e6)
        acc.append(r["server_accuracy"] if r["server_accuracy"] is not None else r["fed_accuracy"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ups, acc, marker="o", label="against uplink bytes")
    ax.plot(boths, acc, marker=".", linestyle=":", label="against total bytes")
    ax.set(title=f"{title}: accuracy against bytes moved", xlabel="cumulative MB on the wire", ylabel="accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
