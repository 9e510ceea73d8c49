"""The enrolled devices, kept in the run store: what a standby aggregator needs to take over a federation.

A device's enrolment lives in three places on its aggregator host: Quorum's
registry (name, node id, public keys), the secure-aggregation directory built
from it, and the node row that the SuperLink keeps in its own SQLite link
state (node id, SuperNode public key, owner, status). None of them can be
read once that host is gone, so every enrolment and revocation also writes
one row here, in the database both aggregators share: the registry's record
and the SuperLink's node record, as Flower's Control API lists it. A standby
that takes over rebuilds its files and its SuperLink's node rows from these
rows (``deploy/devices_sync.py``); the devices keep their node ids and keys,
reconnect through the front door and are never enrolled again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sqlalchemy import JSON, Float, String, delete, select
from sqlalchemy.orm import Mapped, mapped_column

from runstore.base import Base

if TYPE_CHECKING:
    from runstore.store import RunStore

__all__ = ["DeviceRow", "save_devices", "stored_devices"]


class DeviceRow(Base):
    """One enrolled (or revoked) device: Quorum's registry record and the SuperLink's node record."""

    __tablename__ = "devices"
    # a uint64: above a BIGINT's range for half of Flower's ids, so kept as its decimal digits
    node_id: Mapped[str] = mapped_column(String(20), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), index=True)
    record: Mapped[dict[str, Any]] = mapped_column(JSON)   # deploy.enroll.Device's fields
    node: Mapped[dict[str, Any]] = mapped_column(JSON)     # Flower's NodeInfo fields, public_key in hex
    updated_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


def save_devices(store: RunStore, rows: list[DeviceRow], replace: bool = False) -> None:
    """Write ``rows`` (by node id, over any earlier row of the same node) in one transaction.

    ``replace``: the rows are the whole federation; rows of other nodes are deleted.
    """
    now = time.time()
    with store.session() as s, s.begin():
        if replace:
            s.execute(delete(DeviceRow).where(DeviceRow.node_id.not_in([r.node_id for r in rows])))
        for row in rows:
            row.updated_at = now
            s.merge(row)


def stored_devices(store: RunStore) -> list[DeviceRow]:
    """Every device row of the store, enrolled ones and revoked ones, by name then node id."""
    with store.session() as s:
        return list(s.scalars(select(DeviceRow).order_by(DeviceRow.name, DeviceRow.node_id)))
