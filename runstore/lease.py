"""A run's lease: how the store tells a run in progress from one whose process died.

The process that drives a run (``quorum simulate`` / ``resume``, a ServerApp,
rank 0 of a data-parallel job) holds a :class:`Heartbeat` while the run is
``running``: a daemon thread that writes ``heartbeat_at = now`` and
``lease_until = now + lease`` into the run's row every ``lease / RENEWALS``
seconds. A process killed with SIGKILL, or a machine that lost power, stops
renewing; once ``lease_until`` has passed, every reader (``quorum runs``,
``/api/runs``, the dashboard) shows the run as ``interrupted``, last seen at
``heartbeat_at``, and ``quorum resume`` continues it. The stored status stays
``running``: nothing but the owner writes the row, so a process that was only
paused (a suspended laptop) renews on waking and reads ``running`` again.

Readers compare ``lease_until`` with their own clock: the writer chose the
length, so a reader needs no setting, and the default leaves half a minute of
slack for clocks of two hosts sharing a PostgreSQL store.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from core.errors import StoreError
from core.status import RunStatus

__all__ = ["LEASE_S", "RENEWALS", "LEASE_ENV", "INTERRUPTED", "lease_seconds", "lease_expired", "Heartbeat"]

#: Seconds a run counts as alive after its owner's last renewal (``QUORUM_LEASE_S`` overrides it).
LEASE_S = 30.0
#: Renewals per lease (every 5 s by default): five in a row may fail (a busy store) before a live run
#: reads ``interrupted``.
RENEWALS = 6
#: The environment variable that sets the lease in seconds (tests use a second or two).
LEASE_ENV = "QUORUM_LEASE_S"
#: What readers show for a ``running`` run whose lease has expired.
INTERRUPTED = RunStatus.INTERRUPTED


def lease_seconds() -> float:
    """Return the lease this process grants its runs: ``QUORUM_LEASE_S``, else :data:`LEASE_S`."""
    raw = os.environ.get(LEASE_ENV, "").strip()
    if not raw:
        return LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise StoreError(f"{LEASE_ENV}={raw!r}: the run lease must be a number of seconds above 0 (default "
                         f"{LEASE_S:g})")
    return value


def lease_expired(status: str, lease_until: float | None, now: float) -> bool:
    """Whether a run with this stored ``status`` and lease reads ``interrupted`` at ``now``.

    Only a ``running`` run has a lease to lose; one without a lease (written
    by a Quorum older than the lease) is taken at its word.
    """
    return status == RunStatus.RUNNING and lease_until is not None and lease_until < now


class _Renews(Protocol):
    def renew_lease(self, run_id: str, lease_s: float) -> None: ...


class Heartbeat:
    """Renews one run's lease from a daemon thread, from ``start`` (or ``with``) to ``stop``.

    A renewal that fails (a locked SQLite file, a PostgreSQL restart) is
    retried at the next beat; the thread dies with the process, which is the
    point: then nothing renews and the run reads ``interrupted``.
    """

    def __init__(self, store: _Renews, run_id: str, lease_s: float | None = None) -> None:
        self.store, self.run_id = store, run_id
        self.lease_s = lease_seconds() if lease_s is None else lease_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"quorum-lease-{run_id}", daemon=True)

    def start(self) -> Heartbeat:
        """Renew the lease once now, then start the renewing thread; return this heartbeat."""
        self.store.renew_lease(self.run_id, self.lease_s)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing, and wait up to one lease for the thread to end."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.lease_s)

    def __enter__(self) -> Heartbeat:
        """Start the heartbeat (:meth:`start`)."""
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        """Stop the heartbeat (:meth:`stop`), whatever ended the block."""
        self.stop()

    def _beat(self) -> None:
        while not self._stopped.wait(self.lease_s / RENEWALS):
            try:
                self.store.renew_lease(self.run_id, self.lease_s)
            except (SQLAlchemyError, StoreError):
                continue  # the next beat tries again; the lease has RENEWALS - 1 beats of slack
