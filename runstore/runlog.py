"""One run's writer: every driver of a run logs, commits and ends it through a :class:`RunLog`.

The federated round loop (``aggregator.rounds``), FedBuff's buffered steps
(``aggregator.fedbuff``) and the data-parallel mode's rank 0
(``runtimes.parallel``) each hold one for the run they drive: while they hold
it, its lease is renewed (:class:`~runstore.lease.Heartbeat`), a round is
committed with its checkpoint in one transaction
(:meth:`~runstore.store.RunStore.commit_round`), and the run ends with one
status. The run's row itself is created by whoever opens the run
(``aggregator.serverapp.open_run``, ``runtimes.parallel.runlog.create_run``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.exc import SQLAlchemyError

from core.errors import QuorumError
from core.records import ClientRecord, RoundRecord
from core.status import ClientStatus
from core.strategy import ServerState
from runstore.audit import POLICY_REFUSAL, append
from runstore.lease import Heartbeat
from runstore.store import RunStore

__all__ = ["RunLog"]


@dataclass
class RunLog:
    """The writer of run ``run_id`` in ``store``, for the process that drives it."""

    store: RunStore
    run_id: str
    heartbeat: Heartbeat | None = field(default=None, repr=False)

    def hold(self) -> RunLog:
        """Start renewing the run's lease: this process drives the run until :meth:`end` or :meth:`release`."""
        if self.heartbeat is None:
            self.heartbeat = Heartbeat(self.store, self.run_id).start()
        return self

    def log(self, message: str, level: str = "info") -> None:
        """Record an event of the run (shown on its page and by ``quorum runs``)."""
        self.store.log(self.run_id, message, level)

    def commit(self, record: RoundRecord, state: ServerState) -> None:
        """Commit one round (or FedBuff step) with the state after it, checkpoint first, in one transaction.

        Then each client its site policy refused is appended to the audit trail
        (``device:NAME``, the run, the round and the rule), after the round: a
        trail that cannot be written loses no round, and says so in the run's log.
        """
        self.store.commit_round(self.run_id, record, state)
        refused = [c for c in record.clients if c.outcome == ClientStatus.REFUSED]
        if refused:
            self._audit_refusals(record.round, refused)

    def _audit_refusals(self, server_round: int, refused: list[ClientRecord]) -> None:
        devices = (self.store.get_run(self.run_id).info or {}).get("devices") or {}
        orgs = (self.store.get_run(self.run_id).info or {}).get("orgs") or {}
        try:
            for c in refused:
                name = str(devices.get(c.client, c.client))[:56] if isinstance(devices, dict) else c.client[:56]
                append(self.store, f"device:{name}", POLICY_REFUSAL, target=self.run_id,
                       org=str(orgs.get(name, "") if isinstance(orgs, dict) else "")[:64],
                       detail={"round": server_round, "client": c.client[:64], "reason": (c.reason or "")[:500]})
        except (QuorumError, SQLAlchemyError) as exc:
            self.log(f"round {server_round}: {len(refused)} site policy refusal(s) not in the audit trail: "
                     f"{str(exc).splitlines()[0]}", "warning")

    def release(self) -> None:
        """Stop renewing the lease, the run's status left as it is."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def end(self, status: str, error: str | None = None, *, log_error: bool = False) -> None:
        """Stop renewing the lease and set the run's final ``status`` (with ``error``, also logged if asked)."""
        self.release()
        self.store.set_status(self.run_id, status, error=error)
        if error and log_error:
            self.log(error, "error")
