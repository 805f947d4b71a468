"""comparison_shards: sharded comparisons (contiguous pair ranges judged by several workers, merged once)

Revision ID: 0005_i14
Revises: 0004_i11d
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_i14"
down_revision: str | None = "0004_i11d"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("comparisons") as batch:
        batch.add_column(sa.Column("shards", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("shards_done", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("shard_plan", sa.JSON(), nullable=True))
    op.create_table(
        "comparison_shards",
        sa.Column("id", sa.String(length=48), nullable=False),
        sa.Column("comparison_id", sa.String(length=32), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("start", sa.Integer(), nullable=False),
        sa.Column("stop", sa.Integer(), nullable=False),
        sa.Column("tensor_bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("results", sa.LargeBinary(), nullable=True),
        sa.ForeignKeyConstraint(["comparison_id"], ["comparisons.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("comparison_id", "index", name="uq_comparison_shards_index"),
    )
    op.create_index("ix_comparison_shards_status_lease", "comparison_shards", ["status", "lease_until"])


def downgrade() -> None:
    op.drop_index("ix_comparison_shards_status_lease", table_name="comparison_shards")
    op.drop_table("comparison_shards")
    with op.batch_alter_table("comparisons") as batch:
        batch.drop_column("shard_plan")
        batch.drop_column("shards_done")
        batch.drop_column("shards")
