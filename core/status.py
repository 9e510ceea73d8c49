"""The statuses of a run, of a round and of a client's reply: one enum each, the one place their names are spelled.

Both are ``StrEnum``: a member is its string (``RunStatus.FINISHED ==
"finished"``), so the run store, JSON, the API and the pages hold the same
plain values they always held, and a status read back from any of them
compares equal to its member.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["RunStatus", "ClientStatus", "RoundStatus", "NOT_LEARNED", "ENDED"]


class RunStatus(StrEnum):
    """Where a run stands (``runstore.store.Run.status``)."""

    RUNNING = "running"
    #: every round ran and every client contributed
    FINISHED = "finished"
    #: it reached its end, but some client failed, was rejected, refused by its site policy, or never contributed
    DEGRADED = "degraded"
    FAILED = "failed"
    #: DP's privacy budget was spent before the last round, as the scenario allows
    STOPPED_BUDGET = "stopped_budget"
    #: stopped by Ctrl-C, or (derived by readers, ``runstore.lease``) running with a lease that expired
    INTERRUPTED = "interrupted"


#: A run that ran to its end: never resumed, and exits 0 or 3.
ENDED = frozenset({RunStatus.FINISHED, RunStatus.DEGRADED, RunStatus.STOPPED_BUDGET})


class ClientStatus(StrEnum):
    """What became of one client's reply in a round (``core.records.ClientRecord.outcome``)."""

    OK = "ok"
    #: no reply: the node, its message or its app is gone, or the deadline passed
    DROPPED = "dropped"
    #: replied after the deadline (counted as dropped)
    LATE = "late"
    #: replied, and the reply was refused (malformed, wrong shape, NaN, over the size limit)
    REJECTED = "rejected"
    #: its task raised
    FAILED = "failed"
    #: its device's own site policy refused the round before touching its data (``clients.policy``; the reason
    #: names the rule)
    REFUSED = "refused"
    #: what stores written before ``failed`` existed hold (counted as failed)
    ERROR = "error"


class RoundStatus(StrEnum):
    """What a committed round did to the model (``metrics["status"]`` of a stored round)."""

    #: at least one client update went into the model
    OK = "ok"
    #: too few usable updates (``federation.min_clients``): the model was left as it was
    SKIPPED = "skipped"
    #: the aggregate failed the server's check (``federation.max_update_ratio``, a non-finite value): not applied
    REJECTED = "rejected"
    #: no client answered, so nothing was aggregated (the server optimiser and DP's noise still ran)
    EMPTY = "empty"


#: Rounds in which no client update reached the model: a run of only these learned nothing (``failed``).
NOT_LEARNED = frozenset({RoundStatus.SKIPPED, RoundStatus.REJECTED, RoundStatus.EMPTY})
