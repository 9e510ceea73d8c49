"""The process that drives a run: ``runs.holder`` (``TakenRunStore.take``, fenced writes).

A run's lease says when its driver was last alive; the holder says which
process that driver is. A process that takes over a run whose lease lapsed
writes its own name here, and every write of a run's driver (a round's
commit, a renewal, the final status) checks it on the run's locked row in its
own transaction, so a driver that was only paused can no longer write once
another took its run. Runs written before this revision have no holder and are
taken at their word.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add ``runs.holder`` (unless the store has it)."""
    if "holder" in {c["name"] for c in sa.inspect(op.get_bind()).get_columns("runs")}:
        return
    op.add_column("runs", sa.Column("holder", sa.String(length=128), nullable=True))


def downgrade() -> None:
    """Drop ``runs.holder``."""
    with op.batch_alter_table("runs") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("holder")
