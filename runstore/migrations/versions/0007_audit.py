"""The audit trail: ``audit_log`` (``runstore.audit.AuditLog``), hash-chained rows of who did what.

A store written before this revision gets the table empty: its trail starts
with the first row appended after the upgrade (``quorum audit --verify``).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``audit_log``: id, time, actor, organisation, action, target, detail, prev and digest."""
    if "audit_log" in sa.inspect(op.get_bind()).get_table_names():
        return
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("actor", sa.String(length=64), nullable=False),
        sa.Column("org", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("target", sa.String(length=255), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("prev", sa.String(length=64), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_audit_log_actor", "audit_log", ["actor"])
    op.create_index("ix_audit_log_action", "audit_log", ["action"])


def downgrade() -> None:
    """Drop the table, and the trail with it."""
    op.drop_index("ix_audit_log_action", table_name="audit_log")
    op.drop_index("ix_audit_log_actor", table_name="audit_log")
    op.drop_table("audit_log")
