"""Run a scenario on one machine: the in-process runtime (default) or Flower's Ray.

``simulate`` is the API behind ``quorum simulate`` and ``quorum resume``: it
opens the run store, starts the chosen runtime with the ServerApp logic and
Quorum's ClientApp, and returns a :class:`RunSummary`. This process holds the
run it drives (``runstore.takeover``): should another process take it over,
this one stops at its next write (:class:`~runstore.store.LeaseLost`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aggregator.resume import take_to_resume
from aggregator.serverapp import run_federation
from clients.clientapp import app as client_app
from core.headline import Headline, round_scores
from core.records import RoundRecord
from runstore.report import headline_summary
from runstore.store import Round, RunStore
from runstore.takeover import TakenRunStore
from runtimes.enrolment import secagg_identities
from runtimes.faults import FaultPlan
from runtimes.inprocess import InProcessGrid, NodeSpec
from runtimes.pool import default_workers
from scenarios.errors import ScenarioError
from scenarios.schema import Scenario

__all__ = ["simulate", "RunSummary", "summarize"]


@dataclass(frozen=True)
class RunSummary:
    """What ``simulate`` reports of a finished run: its outcome, last round's scores, client totals and wall time."""

    run_id: str
    scenario: str
    strategy: str
    status: str
    rounds: int
    final_accuracy: float | None
    final_loss: float | None
    final_train_loss: float | None
    wall_s: float
    db: str
    error: str | None = None  # why the run failed or degraded, as stored with it
    clients: dict[str, int] | None = None  # answered, dropped, rejected, failed, refused: summed over the rounds
    # The task's headline metric (core.headline): name, direction, final (and its split), best over the rounds
    metric: dict[str, Any] | None = None
    final_scores: dict[str, dict[str, float]] | None = None  # the last round's scores by split, in the task's names

    def to_json(self) -> dict[str, Any]:
        """Return the fields as a dict, for JSON output."""
        return dict(self.__dict__)


def simulate(scenario: Scenario, *, db_url: str, engine: str = "inprocess",
             resume_id: str | None = None, on_round: Callable[[RoundRecord], None] | None = None,
             on_start: Callable[[str], None] | None = None, workers: int | None = None,
             threads: int | None = None, ray_address: str | None = None, holder: str | None = None) -> RunSummary:
    """Run ``scenario`` (or resume run ``resume_id``) and summarise it.

    ``workers`` (in-process engine): client calls at a time, on that many
    forked processes; default one per core, 1 runs them in this process.
    ``threads``: torch threads per worker (default: cores / workers).
    ``ray_address`` (Ray engine): a running Ray cluster to join instead of starting one.

    This process takes the run it drives (``runstore.takeover``): a new run as
    it starts; a run to resume before anything is written, refused
    (:class:`~runstore.takeover.RunHeld`) while another live process drives
    it, unless ``holder`` names the holder the caller took it for already
    (``quorum resume`` takes it before it prints anything). A run to resume
    that this call took and never drove is handed back (its lease ended) when
    the call fails or is interrupted.

    Raises
    ------
    runstore.store.LeaseLost
        Another process took the run over; this one stopped without writing to it again.
    """
    started = time.monotonic()
    if scenario.data.dataset == "file" and not scenario.data.path and not scenario.task.entry:
        raise ScenarioError(f"{scenario.name}: data.dataset = \"file\" without data.path: the data live on the "
                            "devices alone, so this scenario is deployed (quorum aggregator run), not simulated; "
                            "set data.path to a file to simulate it")
    if scenario.asynchronous.enabled and scenario.asynchronous.clock == "virtual" and engine != "inprocess":
        raise ScenarioError(f"{scenario.name}: async.clock = \"virtual\" simulates device speeds on the in-process "
                            f"engine only, not engine {engine!r}; set async.clock = \"wall\" to run in real time")
    with TakenRunStore(db_url, holder) as store:  # its connections closed at the end: a database server's too
        if resume_id is not None and holder is None:
            resume_id = take_to_resume(store, resume_id, scenario).id
        try:
            if engine == "ray":
                from runtimes.ray_engine import RayOptions, run_on_ray

                run_id = run_on_ray(scenario, db_url, resume_id=resume_id, on_round=on_round,
                                    on_start=_taking(store, resume_id, on_start),
                                    options=RayOptions(address=ray_address))
            elif engine == "inprocess":
                if workers is not None and workers < 1:
                    raise ScenarioError(f"workers must be at least 1, got {workers}")
                pool = _Pool(default_workers() if workers is None else workers, threads)
                run_id = _run_inprocess(scenario, store, resume_id, on_round, _taking(store, resume_id, on_start),
                                        pool)
            else:
                raise ValueError(f"engine must be 'inprocess' or 'ray', got {engine!r}")
        except BaseException:
            if resume_id is not None:
                store.release(resume_id)  # a no-op once the run was driven: its driver ended the lease
            raise
        return summarize(store, run_id, time.monotonic() - started)


def _taking(store: TakenRunStore, resume_id: str | None,
            on_start: Callable[[str], None] | None) -> Callable[[str], None]:
    """``on_start``, after taking a new run for ``store`` (a run to resume is taken before it starts)."""

    def start(run_id: str) -> None:
        if resume_id is None:
            store.take(run_id)
        if on_start is not None:
            on_start(run_id)

    return start


@dataclass(frozen=True)
class _Pool:
    workers: int
    threads: int | None


def _run_inprocess(scenario: Scenario, store: RunStore, resume_id: str | None,
                   on_round: Callable[[RoundRecord], None] | None,
                   on_start: Callable[[str], None] | None, pool: _Pool) -> str:
    n = scenario.federation.clients
    identities = secagg_identities(scenario)
    # a generator: the grid copies each node's config into its context, and 100,000 more dicts would stay alive
    nodes = (NodeSpec(i + 1, {"partition-id": i, "num-partitions": n, **identities.get(i + 1, {})})
             for i in range(n))
    run_config = {"scenario-json": json.dumps(scenario.to_dict())}
    faults = FaultPlan.from_spec(scenario.faults, scenario.seed)
    with InProcessGrid(client_app, nodes, run_config, faults, workers=pool.workers, threads=pool.threads) as grid:
        run_id, _ = run_federation(grid, scenario, store, engine="inprocess", resume_id=resume_id,
                                   on_round=on_round, on_start=on_start)
    return run_id


def summarize(store: RunStore, run_id: str, wall_s: float) -> RunSummary:
    """Summarise a stored run: its headline figures, ``wall_s`` being how long it took."""
    run = store.get_run(run_id)
    rounds = store.rounds(run_id)
    last = rounds[-1] if rounds else None
    accuracy = loss = None
    if last is not None:
        accuracy = last.server_accuracy if last.server_accuracy is not None else last.fed_accuracy
        loss = last.server_loss if last.server_loss is not None else last.fed_loss
    return RunSummary(run_id=run.id, scenario=run.name, strategy=run.strategy, status=run.status,
                      rounds=len(rounds), final_accuracy=accuracy, final_loss=loss,
                      final_train_loss=last.train_loss if last else None, wall_s=round(wall_s, 3),
                      db=store.url, error=run.error, metric=headline_summary(Headline.from_info(run.info), rounds),
                      final_scores=round_scores(last) if last is not None else {},
                      clients={**{k: sum(getattr(r, k) or 0 for r in rounds)
                                  for k in ("answered", "dropped", "rejected", "failed")},
                               "refused": sum(_refused(r) for r in rounds)})


def _refused(r: Round) -> int:
    """Count the round's clients refused by their site policy (a count the store keeps in the round's metrics)."""
    n = (r.metrics or {}).get("refused", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0
