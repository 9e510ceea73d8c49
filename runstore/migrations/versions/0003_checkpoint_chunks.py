"""Checkpoints in the database: the table of their chunks (``runstore.checkpoints.DatabaseCheckpoints``).

A server store (PostgreSQL) keeps its checkpoints here by default, so every
host that reads the runs reads their models too. A store whose checkpoints are
files gets the table empty.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``checkpoint_chunks``: run, round, the chunk's place, its bytes (unless the store has it)."""
    if "checkpoint_chunks" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "checkpoint_chunks",
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql"), nullable=False),  # 8 MiB chunks
        sa.PrimaryKeyConstraint("run_id", "round", "seq"),
    )


def downgrade() -> None:
    """Drop the table (and the checkpoints kept in it)."""
    op.drop_table("checkpoint_chunks")
