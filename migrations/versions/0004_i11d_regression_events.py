"""regression_events: the audit of who acknowledged, accepted or re-opened a regression, and when

Revision ID: 0004_i11d
Revises: 0004_i11
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_i11d"
down_revision: str | None = "0004_i11"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "regression_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("project_id", sa.Integer(), nullable=False),
        sa.Column("regression_id", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("note", sa.Text(), nullable=True),
        sa.Column("deviation_id", sa.Integer(), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["project_id"], ["projects.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["regression_id"], ["regressions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_regression_events_project_at", "regression_events", ["project_id", "at"])
    op.create_index(op.f("ix_regression_events_regression_id"), "regression_events", ["regression_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_regression_events_regression_id"), table_name="regression_events")
    op.drop_index("ix_regression_events_project_at", table_name="regression_events")
    op.drop_table("regression_events")
