"""The columns added before the store had migrations: a client's download, leases, failed clients, headlines.

Stores written in that time have any subset of them (each Quorum added what it
lacked on open, as nullable columns): a column already there is left as it is.
A store that gets ``rounds.headline`` here recorded no headline, so its rounds'
headline is their accuracy, the server's first, in the same transaction.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ADDED = (
    ("client_results", sa.Column("bytes_out", sa.Integer(), nullable=False, server_default="0")),
    ("runs", sa.Column("heartbeat_at", sa.Float(), nullable=True)),
    ("runs", sa.Column("lease_until", sa.Float(), nullable=True)),
    ("rounds", sa.Column("failed", sa.Integer(), nullable=False, server_default="0")),
    ("rounds", sa.Column("headline", sa.Float(), nullable=True)),
)


def upgrade() -> None:
    """Add the columns the store lacks, and the headlines of its rounds."""
    present = {table: {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}
               for table in {table for table, _ in ADDED}}
    for table, column in ADDED:
        if column.name not in present[table]:
            op.add_column(table, column)
    if "headline" not in present["rounds"]:
        op.execute("UPDATE rounds SET headline = COALESCE(server_accuracy, fed_accuracy)")


def downgrade() -> None:
    """Drop the five columns."""
    for table, column in reversed(ADDED):
        op.drop_column(table, column.name)
