"""Edge aggregators: ``rounds.tree``, each edge's part in a round of a tree (``[hierarchy]``).

A store written before this revision gets the column empty: its rounds ran flat.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add ``rounds.tree`` (JSON, nullable) unless the store has it."""
    if "tree" not in {c["name"] for c in sa.inspect(op.get_bind()).get_columns("rounds")}:
        op.add_column("rounds", sa.Column("tree", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop ``rounds.tree``."""
    op.drop_column("rounds", "tree")
