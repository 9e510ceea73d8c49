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

import threading
from typing import Protocol

from sqlalchemy.exc import SQLAlchemyError

from core.envvars import env_number, show_number
from core.errors import StoreError
from core.status import RunStatus

__all__ = ["LEASE_S", "MIN_LEASE_S", "MAX_LEASE_S", "RENEWALS", "LEASE_ENV", "INTERRUPTED", "lease_seconds",
           "lease_expired", "Heartbeat"]

#: Seconds a run counts as alive after its owner's last renewal (``QUORUM_LEASE_S`` overrides it).
LEASE_S = 30.0
#: Renewals per lease (every 5 s by default): five in a row may fail (a busy store) before a live run
#: reads ``interrupted``.
RENEWALS = 6
#: The shortest lease: renewed every 1/6 of it, a shorter one would write the run's row more than 60 times a
#: second (tests use a second or two).
MIN_LEASE_S = 0.1
#: The longest lease, a week: a killed run reads ``interrupted`` at the latest a week later (and a renewal's
#: wait stays far inside what a timer holds).
MAX_LEASE_S = 7 * 86_400.0
#: The environment variable that sets the lease in seconds, in ``[MIN_LEASE_S, MAX_LEASE_S]``.
LEASE_ENV = "QUORUM_LEASE_S"
#: What readers show for a ``running`` run whose lease has expired.
INTERRUPTED = RunStatus.INTERRUPTED


def lease_seconds() -> float:
    """Return the lease this process grants its runs: ``QUORUM_LEASE_S``, else :data:`LEASE_S`.

    Every run's first lease is read here when the run is created or resumed
    (:meth:`runstore.store.RunStore.create_run`), so a bad value stops the
    command before its first round, not the renewing thread after it.

    Raises
    ------
    StoreError
        The variable is not a number of seconds in ``[MIN_LEASE_S, MAX_LEASE_S]``, in one line naming it.
    """
    return env_number(LEASE_ENV, LEASE_S, MIN_LEASE_S, MAX_LEASE_S, means="the run lease", unit="seconds",
                      error=StoreError)


def _checked(lease_s: float) -> float:
    """Return a lease given in code, refused like :data:`LEASE_ENV` outside its range."""
    if not MIN_LEASE_S <= lease_s <= MAX_LEASE_S:
        raise StoreError(f"lease_s={lease_s!r}: the run lease must be a number of seconds in "
                         f"[{show_number(MIN_LEASE_S)}, {show_number(MAX_LEASE_S)}]")
    return lease_s


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
        self.lease_s = lease_seconds() if lease_s is None else _checked(lease_s)
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
