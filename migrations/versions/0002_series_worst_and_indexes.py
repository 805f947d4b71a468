"""series.worst_severity and indexes for the drift and regression queries

Revision ID: 0002
Revises: 0001
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("series", schema=None) as batch_op:
        batch_op.add_column(sa.Column("worst_severity", sa.Float(), nullable=True))
        batch_op.create_index("ix_series_project_worst", ["project_id", "worst_severity"], unique=False)
    # fill it in for results stored before this revision
    op.execute(
        "UPDATE series SET worst_severity = "
        "(SELECT max(severity) FROM op_results WHERE op_results.series_id = series.id)"
    )
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.create_index("ix_regressions_project_updated", ["project_id", "updated_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.drop_index("ix_regressions_project_updated")
    with op.batch_alter_table("series", schema=None) as batch_op:
        batch_op.drop_index("ix_series_project_worst")
        batch_op.drop_column("worst_severity")
