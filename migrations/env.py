"""alembic environment: the URL comes from opband's settings (or the config opband passes in)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from api.store.db import make_engine
from api.store.models import Base
from api.settings import Settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    return url or Settings().effective_database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def _migrate(connection: Connection) -> None:
    """Run the migrations. On SQLite, foreign keys are off meanwhile: a batch migration rebuilds a table
    (copy, drop, rename), and with them on, dropping ``series`` would cascade into ``regressions`` and
    null ``op_results.series_id``. Afterwards every reference is checked, so a migration cannot leave
    a dangling one behind."""
    sqlite = connection.dialect.name == "sqlite"
    if sqlite:
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")  # outside any transaction, or it is ignored
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()
    if sqlite:
        broken = connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
        if broken:
            connection.rollback()
            raise RuntimeError(f"the migration would leave {len(broken)} broken references, e.g. {broken[:3]}; "
                               "nothing was changed")
        connection.commit()
        connection.exec_driver_sql("PRAGMA foreign_keys=ON")


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        _migrate(connectable)
        return
    engine = make_engine(_url())
    with engine.connect() as connection:
        _migrate(connection)
        connection.commit()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
