"""bundles.target (the target name series are kept under) and bundles.tags

Revision ID: 0004_i11
Revises: 0003

Existing bundles get the target name their series already use, ``variant@device`` (or the
manifest's ``run.target`` where one is recorded), and their ``run.tags`` as tags, so series and
regressions stay attached. The downgrade drops both columns; series of named targets keep their
names (the older code then starts ``variant@device`` series next to them).
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_i11"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # NOT NULL with a server default so the columns can be added to tables that hold rows (SQLite
    # without rebuilding ``bundles``, which other tables reference); every insert sets them anyway
    op.add_column("bundles", sa.Column("target", sa.String(length=200), nullable=False, server_default=""))
    op.add_column("bundles", sa.Column("tags", sa.JSON(), nullable=False, server_default="{}"))
    conn = op.get_bind()
    bundles = sa.table("bundles", sa.column("id", sa.String), sa.column("variant", sa.String),
                       sa.column("device", sa.String), sa.column("run", sa.JSON), sa.column("target", sa.String),
                       sa.column("tags", sa.JSON))
    for row in conn.execute(sa.select(bundles.c.id, bundles.c.variant, bundles.c.device, bundles.c.run)).fetchall():
        run = row.run if isinstance(row.run, dict) else {}
        named = run.get("target")
        target = named if isinstance(named, str) and named else f"{row.variant}@{row.device}"
        tags = run.get("tags")
        tags = {str(k): str(v) for k, v in tags.items()} if isinstance(tags, dict) else {}
        conn.execute(sa.update(bundles).where(bundles.c.id == row.id).values(target=target[:200], tags=tags))
    op.create_index("ix_bundles_project_target", "bundles", ["project_id", "target"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_bundles_project_target", table_name="bundles")
    if op.get_bind().dialect.name == "sqlite":  # native DROP COLUMN: a batch rebuild of a referenced table fails
        op.execute("ALTER TABLE bundles DROP COLUMN tags")
        op.execute("ALTER TABLE bundles DROP COLUMN target")
    else:
        op.drop_column("bundles", "tags")
        op.drop_column("bundles", "target")
