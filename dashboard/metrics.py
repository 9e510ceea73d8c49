"""Prometheus metrics, read from the run store at scrape time.

A custom collector (no counters kept in this process): the store is the
source of truth, so every dashboard replica reports the same figures and a
restart loses nothing. One aggregate query per scrape; each series is
labelled with its ``run``, and ``quorum_run_info`` carries the scenario,
strategy and status for joins. A task's own scores are labelled gauges:
``quorum_run_metric`` / ``quorum_run_best_metric`` (the task's headline
metric, labelled ``metric`` and ``direction``) and ``quorum_run_task_metric``
(every score of the last round, labelled ``metric`` and ``split``).

A run over edge aggregators (``[hierarchy]``) adds each edge's figures of
its last committed round, labelled ``run`` and ``edge``: its devices by
outcome, its sub-round's time, its traffic, and whether its devices were
lost. Only the last round, and at most ``dashboard.views.MAX_EDGES`` edges a
run, so the series stay bounded; a second row for one edge is left out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from core.headline import Headline
from core.status import RunStatus
from dashboard.queries import Reader, RunStats
from dashboard.views import EDGE_BYTES, EDGE_COUNTS, MAX_EDGES, tree_edges
from runstore.store import Run

__all__ = ["StoreCollector", "make_registry", "render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_COUNTERS = (  # (name, help, RunStats field)
    ("quorum_run_rounds_completed", "Rounds committed to the store.", "rounds"),
    ("quorum_run_clients_answered", "Client updates accepted, summed over rounds.", "answered"),
    ("quorum_run_clients_dropped", "Clients that dropped or were late, summed over rounds.", "dropped"),
    ("quorum_run_clients_rejected", "Client replies rejected, summed over rounds.", "rejected"),
    ("quorum_run_clients_failed", "Client tasks that raised, summed over rounds.", "failed"),
    ("quorum_run_bytes_in", "Bytes received from clients.", "bytes_in"),
    ("quorum_run_bytes_out", "Bytes sent to clients.", "bytes_out"),
)
_GAUGES = (
    ("quorum_run_epsilon", "Differential privacy budget spent (epsilon); only runs with DP.", "epsilon"),
    ("quorum_run_accuracy", "Accuracy after the last committed round.", "last_accuracy"),
    ("quorum_run_best_accuracy", "Best accuracy of any round.", "best_accuracy"),
    ("quorum_run_last_round_duration_seconds", "Duration of the last committed round.", "last_duration"),
)


class StoreCollector(Collector):
    """Collects per-run figures from the store on each scrape."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader

    def collect(self) -> Iterator[Metric]:
        """Yield every metric family, read from the store in one pass over its runs."""
        runs = self.reader.runs()
        yield _status_counts(runs)
        yield _info(runs)
        for name, help_, attr in _COUNTERS:
            family = CounterMetricFamily(name, help_, labels=["run"])
            for run, stats in runs:
                family.add_metric([run.id], getattr(stats, attr))
            yield family
        for name, help_, attr in _GAUGES:
            gauge = GaugeMetricFamily(name, help_, labels=["run"])
            for run, stats in runs:
                if getattr(stats, attr) is not None:
                    gauge.add_metric([run.id], getattr(stats, attr))
            yield gauge
        yield from _task_metrics(runs)
        yield from _edge_metrics(runs, self.reader.last_trees())
        durations = SummaryMetricFamily("quorum_run_round_duration_seconds", "Round wall time.", labels=["run"])
        for run, stats in runs:
            durations.add_metric([run.id], count_value=stats.rounds, sum_value=stats.duration_sum)
        yield durations


def _task_metrics(runs: list[tuple[Run, RunStats]]) -> Iterator[GaugeMetricFamily]:
    """Yield the task's headline metric (last and best) and every score of the last round, labelled by name."""
    last = GaugeMetricFamily("quorum_run_metric", "The task's headline metric after the last committed round "
                             "(server, else federated).", labels=["run", "metric", "direction"])
    best = GaugeMetricFamily("quorum_run_best_metric", "Best value of the task's headline metric over the rounds "
                             "(highest if its direction is up, lowest if down).", labels=["run", "metric", "direction"])
    scores = GaugeMetricFamily("quorum_run_task_metric", "Every score the task returned in the last committed "
                               "round; split: server (held-out set) or federated (clients' test splits, weighted).",
                               labels=["run", "metric", "split"])
    for run, stats in runs:
        headline = Headline.from_info(run.info)
        labels = [run.id, headline.name, headline.direction]
        if stats.last_metric is not None:
            last.add_metric(labels, stats.last_metric)
        value = stats.metric_high if headline.higher_is_better else stats.metric_low
        if value is not None:
            best.add_metric(labels, value)
        for split, values in stats.last_scores.items():
            for name, score in sorted(values.items()):
                scores.add_metric([run.id, name, split], score)
    yield from (last, best, scores)


def _edge_metrics(runs: list[tuple[Run, RunStats]], trees: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    """Yield each edge's figures of each run's last committed round (``trees``: run id -> that round's tree)."""
    bound = f"Last committed round of each run over edge aggregators; at most {MAX_EDGES:,} edges a run."
    devices = GaugeMetricFamily("quorum_edge_devices", "An edge's sampled devices, and how many of them answered, "
                                f"dropped, were rejected, failed or refused. {bound}",
                                labels=["run", "edge", "outcome"])
    seconds = GaugeMetricFamily("quorum_edge_round_seconds", f"An edge's sub-round wall time. {bound}",
                                labels=["run", "edge"])
    traffic = GaugeMetricFamily("quorum_edge_bytes", "An edge's traffic: down (the instruction sent to it), up (its "
                                f"partial sum), devices (what its devices sent it). {bound}",
                                labels=["run", "edge", "direction"])
    problem = GaugeMetricFamily("quorum_edge_problem", "1 when an edge's devices were lost (its sub-round failed or "
                                f"its partial sum was refused), else 0. {bound}", labels=["run", "edge"])
    for run, _ in runs:
        for row in tree_edges(trees.get(run.id)):
            if not row["first"]:  # no edge number to label it with, or a second row for one edge
                continue
            labels = [run.id, str(row["edge"])]
            for outcome in EDGE_COUNTS:
                if row[outcome] is not None:
                    devices.add_metric([*labels, outcome], row[outcome])
            if row["seconds"] is not None:
                seconds.add_metric(labels, row["seconds"])
            for direction, key in EDGE_BYTES:
                if row[key] is not None:
                    traffic.add_metric([*labels, direction], row[key])
            problem.add_metric(labels, 1 if row["problem"] else 0)
    yield from (devices, seconds, traffic, problem)


def _status_counts(runs: list[tuple[Run, RunStats]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily("quorum_runs", "Runs in the store, by status.", labels=["status"])
    counts: dict[str, int] = {}
    for run, _ in runs:
        counts[run.status] = counts.get(run.status, 0) + 1
    for status in sorted({*RunStatus, *counts}):
        family.add_metric([status], counts.get(status, 0))
    return family


def _info(runs: list[tuple[Run, RunStats]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily("quorum_run_info", "One series per run; its labels describe the run.",
                               labels=["run", "scenario", "strategy", "status"])
    for run, _ in runs:
        family.add_metric([run.id, run.name, run.strategy, run.status], 1)
    return family


def make_registry(reader: Reader) -> CollectorRegistry:
    """Return a Prometheus registry holding a :class:`StoreCollector` over ``reader``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(reader))
    return registry


def render_metrics(registry: CollectorRegistry) -> bytes:
    """Render the registry's metrics in the Prometheus text exposition format."""
    return generate_latest(registry)
