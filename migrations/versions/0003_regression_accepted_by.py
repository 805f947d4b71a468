"""regressions.accepted_by: which accepted deviation silenced a regression

Revision ID: 0003
Revises: 0002
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("accepted_by", sa.Integer(), nullable=True))
        batch_op.create_foreign_key("fk_regressions_accepted_by", "accepted_deviations", ["accepted_by"], ["id"],
                                    ondelete="SET NULL")
    # Regressions accepted before this revision: credit the oldest deviation that matches them
    # (the same rule as the comparison job: key glob + optional exact shape signature), so that
    # they too open again once it expires. Done in Python: fnmatch globs are not SQL LIKE.
    import fnmatch

    conn = op.get_bind()
    devs = conn.execute(sa.text("SELECT id, project_id, key_pattern, shape_signature FROM accepted_deviations "
                                "ORDER BY id")).fetchall()
    regs = conn.execute(sa.text("SELECT id, project_id, key, shape_signature FROM regressions "
                                "WHERE status = 'accepted'")).fetchall()
    for reg in regs:
        for d in devs:
            if d.project_id == reg.project_id and fnmatch.fnmatchcase(reg.key, d.key_pattern) \
                    and d.shape_signature in (None, reg.shape_signature):
                conn.execute(sa.text("UPDATE regressions SET accepted_by = :d WHERE id = :r"), {"d": d.id, "r": reg.id})
                break


def downgrade() -> None:
    with op.batch_alter_table("regressions", schema=None) as batch_op:
        batch_op.drop_constraint("fk_regressions_accepted_by", type_="foreignkey")
        batch_op.drop_column("accepted_by")
