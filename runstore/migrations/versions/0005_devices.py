"""Enrolled devices in the store: ``devices`` (``runstore.devices.DeviceRow``), for a standby aggregator.

Each enrolment and revocation writes the device's registry record and the
SuperLink's node record here, so an aggregator that takes over the federation
on another host rebuilds them without re-enrolling a device. A store written
before this revision gets the table empty; the next ``quorum aggregator
start`` fills it from its host's registry.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``devices``: node id, name, the two records, when updated and revoked (unless the store has it)."""
    if "devices" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "devices",
        sa.Column("node_id", sa.String(length=20), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.Column("node", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("node_id"),
    )
    op.create_index("ix_devices_name", "devices", ["name"])


def downgrade() -> None:
    """Drop the table (the hosts' registry files keep the devices)."""
    op.drop_index("ix_devices_name", table_name="devices")
    op.drop_table("devices")
