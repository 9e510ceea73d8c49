"""Server-Sent Events: new rounds and run changes, pushed to open pages.

Each stream polls the store with one primary-key lookup every half second
(a run's status and its highest committed round), in a worker thread so the
event loop never waits on SQLite, and fetches rows only when something
changed. A committed round reaches the page within about a second.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.sse import ServerSentEvent
from starlette.concurrency import run_in_threadpool

from dashboard.queries import TERMINAL, Reader, changed_at
from dashboard.views import round_data, round_display, run_data, run_display

__all__ = ["run_events", "runs_events", "POLL_S"]

POLL_S = 0.5
RUNS_POLL_S = 1.0
RETRY_MS = 2000  # how long a browser waits before reconnecting a dropped stream


async def run_events(reader: Reader, run_id: str, after: int, poll_s: float = POLL_S
                     ) -> AsyncIterator[ServerSentEvent]:
    """``round`` events for rounds after ``after``, ``run`` events on any change; ends with the run."""
    seen = None
    metric = (await run_in_threadpool(reader.headline, run_id)).name
    while True:
        head = await run_in_threadpool(reader.head, run_id)
        if head is None:
            yield ServerSentEvent(event="gone", data={"run_id": run_id}, retry=RETRY_MS)
            return
        if head.last_round > after:
            for row in await run_in_threadpool(reader.rounds, run_id, after):
                data = round_data(row)
                yield ServerSentEvent(event="round", id=str(row.round), retry=RETRY_MS,
                                      data={"round": data, "display": round_display(data, metric)})
                after = row.round
        if (head.status, head.updated_at) != seen:
            seen = (head.status, head.updated_at)
            yield await _run_event(reader, run_id)
        if head.status in TERMINAL:
            return
        await asyncio.sleep(poll_s)


async def runs_events(reader: Reader, since: float | None, poll_s: float = RUNS_POLL_S
                      ) -> AsyncIterator[ServerSentEvent]:
    """Yield a ``run`` event whenever a run starts, commits a round or changes status.

    After each batch of changes comes one ``counts`` event (runs per status,
    and in all). ``since`` None starts from the store's latest change; the
    store is polled every ``poll_s`` seconds, forever.
    """
    if since is None:
        since = await run_in_threadpool(reader.last_update)
    while True:
        changed = await run_in_threadpool(reader.changed_runs, since)
        for run, stats in sorted(changed, key=lambda pair: changed_at(pair[0])):
            data = run_data(run, stats)
            yield ServerSentEvent(event="run", retry=RETRY_MS, data={"run": data, "display": run_display(data)})
            since = max(since, changed_at(run))
        if changed:
            counts = await run_in_threadpool(reader.status_counts)
            yield ServerSentEvent(event="counts", retry=RETRY_MS,
                                  data={"counts": counts, "total": sum(counts.values())})
        await asyncio.sleep(poll_s)


async def _run_event(reader: Reader, run_id: str) -> ServerSentEvent:
    found = await run_in_threadpool(reader.run, run_id)
    if found is None:
        return ServerSentEvent(event="gone", data={"run_id": run_id})
    data = run_data(*found)
    return ServerSentEvent(event="run", retry=RETRY_MS, data={"run": data, "display": run_display(data)})
