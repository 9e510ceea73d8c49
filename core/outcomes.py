"""A client's part in a round in one word, a round's counts in one line, and a run's end as an exit code.

Every runtime and train workflow records each sampled client as one of:

- ``ok``: its reply was taken into the round;
- ``dropped``: it did not answer: killed, unreachable, past the deadline. A
  Flower error reply that says the node or its message is gone
  (``NODE_UNAVAILABLE``, ``REPLY_MESSAGE_UNAVAILABLE``, ``MESSAGE_UNAVAILABLE``,
  ``CLIENT_APP_CRASHED``) is a client that did not answer, not an error of its own;
- ``rejected``: it answered and the aggregator refused the reply, with the reason;
- ``failed``: its task raised (``CLIENT_APP_RAISED_EXCEPTION``, a ClientApp that
  could not load, ...), with the error it reported;
- ``refused``: its device's own site policy refused the round before touching
  its data (``clients.policy``, a :func:`core.replies.refusal` reply), with the rule;
- ``late``: a reply that came too late to count (an asynchronous reply staler
  than ``max_staleness``); counted with the dropped.

Stores written before ``failed`` existed hold ``error`` for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flwr.app import Error
from flwr.common.constant import ErrorCode

from core.replies import refusal_reason
from core.status import ClientStatus, RunStatus

__all__ = ["OK", "DROPPED", "REJECTED", "FAILED", "LATE", "REFUSED", "error_outcome", "clean_reason", "Counts",
           "count", "round_line", "run_problems", "refusal_summary", "EXIT_FINISHED", "EXIT_FAILED", "EXIT_DEGRADED",
           "exit_code", "edges_line"]

OK, DROPPED, REJECTED, FAILED, LATE, REFUSED = (ClientStatus.OK, ClientStatus.DROPPED, ClientStatus.REJECTED,
                                                ClientStatus.FAILED, ClientStatus.LATE, ClientStatus.REFUSED)
#: Outcomes that count as each: ``error`` is what stores written before ``failed`` hold.
_KINDS: dict[str, ClientStatus] = {OK: OK, DROPPED: DROPPED, LATE: DROPPED, REJECTED: REJECTED, FAILED: FAILED,
                                   ClientStatus.ERROR: FAILED, REFUSED: REFUSED}

#: Flower's codes for a reply that never came from the client: the node, its message or its app is gone.
_GONE = frozenset({ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE,
                   ErrorCode.CLIENT_APP_CRASHED})
#: How a SuperNode words an exception its ClientApp raised: ``<class 'pkg.mod.Name'>:<'message'>``.
_FLOWER_REASON = re.compile(r"^<class '(?:[\w.]*\.)?(\w+)'>:<'(.*)'>$", re.DOTALL)
_MAX_REASON = 300


def clean_reason(text: object, limit: int = _MAX_REASON) -> str:
    """Shorten a failure's reason to one line of at most ``limit`` characters.

    ``DataError: no label column 'label'``, also from Flower's
    ``<class 'learning.errors.DataError'>:<'no label column ...'>``.
    """
    reason = str(text).strip()
    match = _FLOWER_REASON.match(reason)
    if match:
        reason = f"{match.group(1)}: {match.group(2)}"
    line = " ".join(reason.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def error_outcome(error: Error) -> tuple[str, str]:
    """``(outcome, reason)`` of a Flower error reply.

    ``refused`` with the rule when the device's site policy refused
    (:func:`core.replies.refusal`), ``dropped`` when the client never
    answered, else ``failed``.
    """
    refused = refusal_reason(error)
    if refused is not None:
        return REFUSED, clean_reason(refused) or "no reason given"
    reason = clean_reason(error.reason) or f"Flower error code {error.code}"
    return (DROPPED if error.code in _GONE else FAILED), reason


class _Result(Protocol):
    """What a client's record carries, in memory (``ClientRecord``) or in the store (``ClientResult``)."""

    @property
    def client(self) -> str: ...
    @property
    def outcome(self) -> str: ...
    @property
    def reason(self) -> str | None: ...


@dataclass(frozen=True)
class Counts:
    """A round's clients by outcome, with ``(client, reason)`` of the rejected, the failed and the refused."""

    answered: int = 0
    dropped: int = 0
    rejected: int = 0
    failed: int = 0
    dropped_clients: tuple[str, ...] = ()
    rejected_clients: tuple[tuple[str, str], ...] = ()
    failed_clients: tuple[tuple[str, str], ...] = ()
    refused: int = 0
    refused_clients: tuple[tuple[str, str], ...] = ()


def count(results: Iterable[_Result], names: Mapping[str, str] | None = None) -> Counts:
    """Tally ``results`` (one per client of a round); ``names`` maps a client label to its name (a device's)."""
    names = names or {}
    tally: dict[str, list[tuple[str, str]]] = {OK: [], DROPPED: [], REJECTED: [], FAILED: [], REFUSED: []}
    for r in results:
        kind = _KINDS.get(r.outcome, FAILED)
        tally[kind].append((_name(r.client, names), clean_reason(r.reason or "")))
    return Counts(answered=len(tally[OK]), dropped=len(tally[DROPPED]), rejected=len(tally[REJECTED]),
                  failed=len(tally[FAILED]), dropped_clients=tuple(c for c, _ in tally[DROPPED]),
                  rejected_clients=tuple(tally[REJECTED]), failed_clients=tuple(tally[FAILED]),
                  refused=len(tally[REFUSED]), refused_clients=tuple(tally[REFUSED]))


def round_line(sampled: int, counts: Counts, shown: int = 2) -> str:
    """Summarise a round's replies in one line.

    ``2/3 answered, 1 failed: device-3 DataError: no label column 'label'``:
    only the counts that are not zero after the first, each naming its first
    ``shown`` clients (and the reason, when one was given). Refusals are
    grouped by the rule: ``2 refused (policy: secure aggregation required [dev0, dev1])``.
    """
    parts = [f"{counts.answered}/{sampled} answered"]
    if counts.dropped:
        parts.append(f"{counts.dropped} dropped ({_names(counts.dropped_clients, shown)})")
    if counts.refused:
        grouped = _by_reason(counts.refused_clients)
        said = "; ".join(f"{why} [{_names(tuple(clients), shown)}]" for why, clients in grouped[:shown])
        more = f"; {len(grouped) - shown} more rules" if len(grouped) > shown else ""
        parts.append(f"{counts.refused} refused (policy: {said}{more})")
    for n, word, clients in ((counts.rejected, REJECTED, counts.rejected_clients),
                             (counts.failed, FAILED, counts.failed_clients)):
        if n:
            said = "; ".join(f"{c} {why}".strip() for c, why in clients[:shown])
            parts.append(f"{n} {word}: {said}" + ("; ..." if n > shown else ""))
    return ", ".join(parts)


def edges_line(tree: Mapping[str, Any] | None) -> str:
    """Say how a round of a tree (``[hierarchy]``) went at its edges: `` via 3 edges`` (empty for a flat round).

    An edge whose sum was lost is named with its reason: `` via 3 edges (1 lost: edge 1's partial sum refused: ...)``.
    """
    edges = tree.get("edges") if isinstance(tree, Mapping) else None
    if not isinstance(edges, list):
        return ""
    lost = [e for e in edges if isinstance(e, Mapping) and e.get("problem")]
    said = f" ({len(lost)} lost: {clean_reason(str(lost[0]['problem']))})" if lost else ""
    return f" via {len(edges)} edge{'s' if len(edges) != 1 else ''}{said}"


def _names(clients: tuple[str, ...], shown: int) -> str:
    return ", ".join(clients[: shown + 1]) + (", ..." if len(clients) > shown + 1 else "")


def _by_reason(refused: Iterable[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Group ``(client, reason)`` pairs by reason: the most clients first, then by reason."""
    groups: dict[str, list[str]] = {}
    for client, why in refused:
        groups.setdefault(why or "no reason given", []).append(client)
    return sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))


EXIT_FINISHED, EXIT_FAILED, EXIT_DEGRADED = 0, 1, 3
#: A run's status -> the exit code of the command that ran or followed it; any other status (failed,
#: interrupted, running) is 1.
_EXIT: dict[str, int] = {RunStatus.FINISHED: EXIT_FINISHED, RunStatus.STOPPED_BUDGET: EXIT_FINISHED,
                         RunStatus.DEGRADED: EXIT_DEGRADED}


def exit_code(status: str) -> int:
    """0 finished (or stopped by its privacy budget, as planned), 3 degraded, 1 any other ending."""
    return _EXIT.get(status, EXIT_FAILED)


class _Participation(_Result, Protocol):
    @property
    def round(self) -> int: ...


def run_problems(results: Iterable[_Participation], names: Mapping[str, str] | None = None,
                 drops_expected: bool = False, shown: int = 3, sites_total: int | None = None) -> list[str]:
    """List what degrades a run, one phrase per client.

    ``results`` may hold only the records of the clients that were ever
    anything but ``ok`` (a client ok in every round degrades nothing), with
    ``sites_total`` the run's clients.

    First the sites whose policy refused (:func:`refusal_summary`), then those
    that failed or were rejected in some round (with the last reason), and
    those sampled that never contributed (dropped whenever asked), unless
    ``drops_expected`` (the scenario injects dropouts). At most ``shown``
    clients, then how many more.
    """
    by_client: dict[str, list[_Participation]] = {}
    for r in results:
        by_client.setdefault(r.client, []).append(r)
    refused = refusal_summary([r for mine in by_client.values() for r in mine], names, sites_total=sites_total)
    found = []
    for client in sorted(by_client, key=_natural):
        mine = by_client[client]
        name = _name(client, names or {})
        rounds = len({r.round for r in mine})
        bad = [r for r in mine if _KINDS.get(r.outcome, FAILED) in (FAILED, REJECTED)]
        if bad:
            word = _KINDS.get(bad[-1].outcome, FAILED)
            found.append(f"{name} {word} in {len({r.round for r in bad})} of {rounds} rounds "
                         f"({clean_reason(bad[-1].reason or 'no reason given')})")
        elif not drops_expected and not any(_KINDS.get(r.outcome) in (OK, REFUSED) for r in mine):
            found.append(f"{name} never contributed (dropped in {rounds} of {rounds} rounds)")
    if len(found) > shown:
        found = [*found[:shown], f"and {len(found) - shown} more clients"]
    return [refused, *found] if refused else found


def refusal_summary(results: Iterable[_Result], names: Mapping[str, str] | None = None, shown: int = 3,
                    sites_total: int | None = None) -> str | None:
    """Say which sites refused under their policy: ``2 of 6 sites refused: secure aggregation required (a, b)``.

    ``results`` are a run's client records; a site is a client that appears in
    them (or ``sites_total`` of them, when ``results`` hold only some sites'
    records); each refusing site counts once, with its last reason. ``None``
    when no site refused.
    """
    sites: set[str] = set()
    last: dict[str, str] = {}
    for r in results:
        sites.add(r.client)
        if _KINDS.get(r.outcome) == REFUSED:
            last[r.client] = clean_reason(r.reason or "")
    if not last:
        return None
    named = [(_name(c, names or {}), why) for c, why in sorted(last.items(), key=lambda kv: _natural(kv[0]))]
    grouped = _by_reason(named)  # the reasons are the clients' words: a few of them, each cut to one short line
    said = "; ".join(f"{why} ({_names(tuple(clients), shown - 1)})" for why, clients in grouped[:shown])
    more = f"; and {len(grouped) - shown} more rules" if len(grouped) > shown else ""
    return f"{len(last)} of {sites_total if sites_total is not None else len(sites)} sites refused: {said}{more}"


def _name(label: str, names: Mapping[str, str]) -> str:
    """Name a client as a line names it: its device's name, else ``client 3`` (a node id), else its label."""
    return names.get(label) or (f"client {label}" if label.isdigit() else label)


def _natural(label: str) -> tuple[int, int, str]:
    return (0, int(label), "") if label.isdigit() else (1, 0, label)
