"""comparisons.generation: a generation's token-level comparison, step by step (issue 32)

Revision ID: 0006_i32
Revises: 0005_i14
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_i32"
down_revision: str | None = "0005_i14"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("comparisons") as batch:
        batch.add_column(sa.Column("generation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("comparisons") as batch:
        batch.drop_column("generation")
