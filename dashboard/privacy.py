"""What a differentially private run keeps from dashboard viewers: who was sampled.

Amplification by sampling (the epsilon a DP run records for anyone who sees
its models) assumes the sample of each round stays secret. In a run whose
scenario enables ``[dp]`` the dashboard therefore shows how many clients were
sampled, answered and dropped, never which ones: no client ids on the round
page, no per-round client list in the API, no per-client history of that run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dashboard.queries import ClientSummary, Reader

__all__ = ["hides_clients", "run_hides_clients", "without_private_runs", "public_clients", "HIDDEN_DETAIL"]

HIDDEN_DETAIL = ("this run is differentially private: which clients were sampled stays hidden "
                 "(amplification by sampling needs it secret); the round's counts are in the round itself")


def hides_clients(scenario: Mapping[str, Any] | None) -> bool:
    """Whether a run with this stored scenario hides its sampled client ids (``[dp] enabled``)."""
    dp = (scenario or {}).get("dp") if isinstance(scenario, Mapping) else None
    return isinstance(dp, Mapping) and bool(dp.get("enabled"))


def run_hides_clients(reader: Reader, run_id: str) -> bool:
    """:func:`hides_clients` for a stored run (``False`` for an unknown run)."""
    found = reader.run(run_id)
    return found is not None and hides_clients(found[0].scenario)


def without_private_runs(reader: Reader, rows: Iterable[Any]) -> list[Any]:
    """``rows`` (each with a ``run_id``) minus those of DP runs."""
    verdict: dict[str, bool] = {}
    kept = []
    for row in rows:
        run_id = str(row.run_id)
        if run_id not in verdict:
            verdict[run_id] = run_hides_clients(reader, run_id)
        if not verdict[run_id]:
            kept.append(row)
    return kept


def public_clients(reader: Reader, limit: int | None = None, offset: int = 0) -> list[ClientSummary]:
    """Sum every client's participation over the runs that do not hide their clients, one page.

    The DP runs are left out in the same SQL query that sums the rest.
    """
    return reader.clients(None, limit, offset, public=True)
