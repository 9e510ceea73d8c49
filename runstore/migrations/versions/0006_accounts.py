"""Accounts and API tokens: ``accounts`` and ``api_tokens`` (``runstore.accounts``), for roles on the dashboard.

A store written before this revision gets both tables empty: its dashboard
keeps its single shared token until an account is added.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create ``accounts`` and ``api_tokens`` (unless the store has them)."""
    tables = sa.inspect(op.get_bind()).get_table_names()
    if "accounts" not in tables:
        op.create_table(
            "accounts",
            sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
            sa.Column("name", sa.String(length=64), nullable=False),
            sa.Column("org", sa.String(length=64), nullable=False),
            sa.Column("role", sa.String(length=16), nullable=False),
            sa.Column("issuer", sa.String(length=255), nullable=True),
            sa.Column("subject", sa.String(length=255), nullable=True),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.Column("revoked_at", sa.Float(), nullable=True),
            sa.PrimaryKeyConstraint("id"),
            sa.UniqueConstraint("name"),
        )
        op.create_index("ix_accounts_org", "accounts", ["org"])
    if "api_tokens" not in tables:
        op.create_table(
            "api_tokens",
            sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
            sa.Column("account_id", sa.Integer(), nullable=False),
            sa.Column("digest", sa.String(length=64), nullable=False),
            sa.Column("shown", sa.String(length=16), nullable=False),
            sa.Column("created_at", sa.Float(), nullable=False),
            sa.Column("expires_at", sa.Float(), nullable=False),
            sa.Column("revoked_at", sa.Float(), nullable=True),
            sa.ForeignKeyConstraint(["account_id"], ["accounts.id"]),
            sa.PrimaryKeyConstraint("id"),
            sa.UniqueConstraint("digest"),
        )
        op.create_index("ix_api_tokens_account_id", "api_tokens", ["account_id"])


def downgrade() -> None:
    """Drop both tables (the dashboard falls back to its shared token)."""
    op.drop_index("ix_api_tokens_account_id", table_name="api_tokens")
    op.drop_table("api_tokens")
    op.drop_index("ix_accounts_org", table_name="accounts")
    op.drop_table("accounts")
