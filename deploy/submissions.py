"""Remote submissions on the aggregator: the leading aggregator takes the dashboard's queued requests and submits them.

The dashboard queues a lead's ``POST /api/runs`` (and stops and resumptions)
in the run store (``runstore/submissions.py``); the supervisor's watch loop,
which runs only on the aggregator that leads the federation, calls
:func:`process_pending` about once a second. Each request taken is carried
out through this host's in-process Control API, as ``quorum aggregator run``
does (``deploy.submit``), and finished ``done`` with the Flower run id, or
``failed`` with the reason in one line.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

from core.errors import QuorumError
from core.status import RunStatus
from deploy.config import DeployConfig
from deploy.flower import stop_run
from deploy.submit import submit
from runstore.store import RunStore
from runstore.submissions import Submission, finish, take
from runstore.takeover import TakenRunStore

__all__ = ["process_pending", "carry_out", "taker_name"]

Say = Callable[[str], None]
#: At most this many requests per call: one slow submission never holds the watch loop for long.
BATCH = 4


def taker_name(config: DeployConfig) -> str:
    """Name this aggregator in a taken submission (``taken_by``): federation, host and process."""
    return f"{config.aggregator.name}@{socket.gethostname()}:{os.getpid()}"


def process_pending(config: DeployConfig, say: Say = print, limit: int = BATCH,
                    store: RunStore | None = None) -> list[int]:
    """Take and carry out up to ``limit`` pending submissions of this federation; return their ids.

    ``store``: the run store, kept open by a caller that asks every second (else opened and closed here).
    """
    done: list[int] = []
    with contextlib.nullcontext(store) if store is not None else RunStore(config.db_url) as store:
        for _ in range(limit):
            found = take(store, taker_name(config), config.aggregator.name)
            if found is None:
                break
            ok, result = carry_out(config, store, found)
            finish(store, found.id, ok, **result)
            say(f"submission {found.id} ({found.kind} by {found.account}): "
                + (f"done {result}" if ok else f"failed: {result.get('error')}"))
            done.append(found.id)
    return done


def carry_out(config: DeployConfig, store: RunStore, found: Submission) -> tuple[bool, dict[str, Any]]:
    """Carry out one taken submission; whether it worked, and its result (a Flower run id, or the error)."""
    try:
        if found.kind == "submit":
            submitter = {"account": found.account, "org": found.org, "submission": found.id}
            return True, {"flower_run_id": submit(config, spec=found.scenario, submitter=submitter)}
        run_id = str(found.run_id)
        old = (store.get_run(run_id).info or {}).get("flower_run_id")
        if found.kind == "stop":
            return _stop(config, store, found, run_id, old)
        if old is not None:  # a crashed run's Flower run may still count as running (Supervisor.resume_interrupted)
            stop_run(config, int(old))
        flower_run = submit(config, resume=run_id)
        # recorded now, not only once its ServerApp opens the run: a stop meanwhile stops this Flower run
        store.update_info(run_id, flower_run_id=flower_run)
        return True, {"flower_run_id": flower_run, "run_id": run_id}
    except (QuorumError, ValueError, OSError) as exc:
        return False, {"error": (str(exc).splitlines() or [type(exc).__name__])[0][:500]}


def _stop(config: DeployConfig, store: RunStore, found: Submission, run_id: str,
          flower_run: Any) -> tuple[bool, dict[str, Any]]:
    """Stop the run's Flower run, and record it failed, "stopped by" its stopper (a lead may resume it later).

    Not ``interrupted``: a restarted aggregator resumes those on its own. The run is taken from its ServerApp
    first (``runstore.takeover``): stopped, that process ends the run itself as ``failed: SystemExit``, which
    reads as a crash (``deploy.supervisor.resumable_runs``), and an aggregator restarted or taking over would
    resume a run its lead stopped. A resume (``carry_out``) takes the run back for its new ServerApp.
    """
    if flower_run is None:
        return False, {"error": f"run {run_id} has no Flower run on this aggregator", "run_id": run_id}
    why = f"stopped by {found.account} (submission {found.id})"
    with TakenRunStore(store.url, holder=f"stop-{found.id}") as taken:
        taken.take(run_id)  # before the stop: the stopped ServerApp's own ending is refused (LeaseLost)
        stopped = stop_run(config, int(flower_run))
        taken.log(run_id, why, "warning")
        taken.set_status(run_id, RunStatus.FAILED, why)
    return True, {"flower_run_id": int(flower_run), "run_id": run_id, "stopped": stopped}
