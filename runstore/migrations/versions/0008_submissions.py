"""Remote submissions: ``submissions`` (``runstore.submissions.SubmissionRow``), the queue the dashboard fills.

A store written before this revision gets the table empty: nothing was
submitted remotely before it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``submissions``: who asked for what, for which federation, and how it went."""
    if "submissions" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "submissions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("account", sa.String(length=64), nullable=False),
        sa.Column("org", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("federation", sa.String(length=64), nullable=True),
        sa.Column("run_id", sa.String(length=64), nullable=True),
        sa.Column("scenario", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("taken_by", sa.String(length=128), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_submissions_account", "submissions", ["account"])
    op.create_index("ix_submissions_federation", "submissions", ["federation"])
    op.create_index("ix_submissions_status", "submissions", ["status"])


def downgrade() -> None:
    """Drop the queue (what was pending is forgotten)."""
    op.drop_index("ix_submissions_status", table_name="submissions")
    op.drop_index("ix_submissions_federation", table_name="submissions")
    op.drop_index("ix_submissions_account", table_name="submissions")
    op.drop_table("submissions")
