"""Migrations on SQLite and PostgreSQL: round trips, no drift from the models, and a server that refuses a stale schema."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from api.store.db import SchemaOutOfDate, current_revision, downgrade, head_revision, make_engine, upgrade
from api.store.models import Base
from api.settings import Settings


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    upgrade(database_url)
    assert tables(database_url) == set(Base.metadata.tables)
    downgrade(database_url, "0001")
    assert "worst_severity" not in {c["name"] for c in inspect(make_engine(database_url)).get_columns("series")}
    downgrade(database_url, "base")
    assert tables(database_url) == set()
    upgrade(database_url)
    engine = make_engine(database_url)
    assert current_revision(engine) == head_revision()
    engine.dispose()


def test_0003_credits_existing_accepted_regressions_to_their_deviation(database_url: str) -> None:
    """Regressions accepted before 0003 name the deviation that matches them, so they open again
    when it expires; a regression accepted by hand (no deviation matches) stays uncredited."""
    from sqlalchemy import text

    upgrade(database_url, "0002")
    engine = make_engine(database_url)
    now = "2026-01-01 00:00:00"
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO projects (id, name, public, created_at) VALUES (1, 'p', false, :t)"), {"t": now})
        conn.execute(text("INSERT INTO bundles (id, project_id, sha256, size, storage_key, variant, device, records, "
                          "run, environment, created_at) VALUES ('b', 1, 'h', 1, 'k', 'fp32', 'cpu', 0, '{}', '{}', :t)"),
                     {"t": now})
        conn.execute(text("INSERT INTO comparisons (id, project_id, reference_id, target_id, mode, status, counts, "
                          "unmatched, attempts, created_at) VALUES ('c', 1, 'b', 'b', 'propagated', 'done', '{}', 0, 0, "
                          ":t)"), {"t": now})
        for sid, key in ((1, "m.mlp/aten.mm#0"), (2, "m.attn/aten.mm#0")):
            conn.execute(text("INSERT INTO series (id, project_id, key, shape_signature, dtype, target, op) "
                              "VALUES (:i, 1, :k, '64', 'float32', 't', 'aten.mm')"), {"i": sid, "k": key})
            conn.execute(text("INSERT INTO regressions (project_id, series_id, key, op, shape_signature, status, "
                              "first_comparison_id, last_comparison_id, reason, created_at, updated_at) VALUES "
                              "(1, :i, :k, 'aten.mm', '64', 'accepted', 'c', 'c', 'r', :t, :t)"), {"i": sid, "k": key, "t": now})
        conn.execute(text("INSERT INTO accepted_deviations (id, project_id, key_pattern, reason, author, created_at) "
                          "VALUES (7, 1, '*.mlp/*', 'r', 'a', :t)"), {"t": now})
    engine.dispose()
    upgrade(database_url)
    engine = make_engine(database_url)
    with engine.connect() as conn:
        got = dict(conn.execute(text("SELECT key, accepted_by FROM regressions")).fetchall())
    engine.dispose()
    assert got == {"m.mlp/aten.mm#0": 7, "m.attn/aten.mm#0": None}
    downgrade(database_url, "0002")
    assert "accepted_by" not in {c["name"] for c in inspect(make_engine(database_url)).get_columns("regressions")}


def test_models_match_migrations(database_url: str) -> None:
    """alembic autogenerate finds nothing to add: the models and the migrations describe one schema."""
    upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ; add a migration: {diff}"


def _lifespan_error(settings: Settings) -> BaseException | None:
    from api.app import create_app

    app = create_app(settings)

    async def run() -> None:
        async with app.router.lifespan_context(app):
            pass

    try:
        asyncio.run(run())
    except BaseException as e:  # noqa: BLE001
        return e
    return None


@pytest.mark.parametrize("revision", [None, "0001"], ids=["empty", "one-behind"])
def test_app_refuses_out_of_date_schema(database_url: str, tmp_path: Path, revision: str | None) -> None:
    if revision:
        upgrade(database_url, revision)
    err = _lifespan_error(Settings(database_url=database_url, data_dir=tmp_path, workers=0))
    assert isinstance(err, SchemaOutOfDate), err
    assert "opband db upgrade" in str(err) and head_revision() in str(err)
    upgrade(database_url)
    assert _lifespan_error(Settings(database_url=database_url, data_dir=tmp_path, workers=0)) is None


def test_worker_and_token_refuse_out_of_date_schema(pg_url: str, tmp_path: Path) -> None:
    """Non-embedded databases are never migrated behind the operator's back: `opband serve` says what to run."""
    env = {"OPBAND_DATABASE_URL": pg_url, "PATH": "/usr/bin:/bin"}
    for args in (["serve", "--port", "0"], ["worker"], ["token", "create", "--project", "p"]):
        out = subprocess.run([sys.executable, "-m", "opband.cli", *args, "--data-dir", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode != 0, args
        assert "opband db upgrade" in out.stderr, (args, out.stderr[-2000:])
        if args[0] != "serve":
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr


def test_downgrade_and_upgrade_keep_the_data(database_url: str) -> None:
    """Before: on SQLite the migrations ran with foreign keys on, so rebuilding `series` in a downgrade
    cascaded: every regression deleted and op_results.series_id set to NULL."""
    from sqlalchemy import text

    upgrade(database_url)
    engine = make_engine(database_url)
    now = "2026-01-01 00:00:00"
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO projects (id, name, public, created_at) VALUES (1, 'p', false, :t)"), {"t": now})
        conn.execute(text("INSERT INTO bundles (id, project_id, sha256, size, storage_key, variant, device, records, "
                          "run, environment, created_at) VALUES ('b', 1, 'h', 1, 'k', 'fp32', 'cpu', 0, '{}', '{}', :t)"),
                     {"t": now})
        conn.execute(text("INSERT INTO comparisons (id, project_id, reference_id, target_id, mode, status, counts, "
                          "unmatched, attempts, created_at) VALUES ('c', 1, 'b', 'b', 'propagated', 'done', '{}', 0, 0, "
                          ":t)"), {"t": now})
        for sid in range(1, 21):
            conn.execute(text("INSERT INTO series (id, project_id, key, shape_signature, dtype, target, op) "
                              "VALUES (:i, 1, :k, '64', 'float32', 't', 'aten.mm')"), {"i": sid, "k": f"m.{sid}/aten.mm#0"})
            conn.execute(text("INSERT INTO op_results (comparison_id, series_id, key, output, op, module, kind, "
                              "\"index\", shape_signature, dtype, verdict, reason, inherited, created_at) VALUES "
                              "('c', :i, :k, 0, 'aten.mm', 'm', 'aten', :i, '64', 'float32', 'fail', 'r', false, :t)"),
                         {"i": sid, "k": f"m.{sid}/aten.mm#0", "t": now})
            conn.execute(text("INSERT INTO regressions (project_id, series_id, key, op, shape_signature, status, "
                              "first_comparison_id, last_comparison_id, reason, created_at, updated_at) VALUES "
                              "(1, :i, :k, 'aten.mm', '64', 'active', 'c', 'c', 'r', :t, :t)"),
                         {"i": sid, "k": f"m.{sid}/aten.mm#0", "t": now})
    engine.dispose()

    def counts() -> tuple[int, int, int]:
        e = make_engine(database_url)
        with e.connect() as conn:
            out = (conn.execute(text("SELECT count(*) FROM regressions")).scalar_one(),
                   conn.execute(text("SELECT count(*) FROM op_results WHERE series_id IS NOT NULL")).scalar_one(),
                   conn.execute(text("SELECT count(*) FROM series")).scalar_one())
        e.dispose()
        return out

    assert counts() == (20, 20, 20)
    downgrade(database_url, "0001")
    assert counts() == (20, 20, 20), "a downgrade keeps every regression and every result's series"
    upgrade(database_url)
    assert counts() == (20, 20, 20)


def test_0005_shards_keep_comparisons_and_cascade(database_url: str) -> None:
    """0005_i14 adds the shard columns (NULL for existing comparisons: unsharded) and comparison_shards, whose
    rows go with their comparison; its downgrade drops them and keeps every comparison."""
    from sqlalchemy import text

    upgrade(database_url, "0004_i11d")
    engine = make_engine(database_url)
    now = "2026-01-01 00:00:00"
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO projects (id, name, public, created_at) VALUES (1, 'p', false, :t)"), {"t": now})
        conn.execute(text("INSERT INTO bundles (id, project_id, sha256, size, storage_key, variant, device, records, "
                          "run, environment, created_at, target, tags) VALUES ('b', 1, 'h', 1, 'k', 'fp32', 'cpu', 0, "
                          "'{}', '{}', :t, 't', '{}')"), {"t": now})
        for cid in ("c1", "c2"):
            conn.execute(text("INSERT INTO comparisons (id, project_id, reference_id, target_id, mode, status, counts, "
                              "unmatched, attempts, created_at) VALUES (:c, 1, 'b', 'b', 'propagated', 'done', '{}', 0, "
                              "0, :t)"), {"c": cid, "t": now})
    engine.dispose()
    upgrade(database_url, "0005_i14")
    engine = make_engine(database_url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT count(*) FROM comparisons WHERE shards IS NULL AND shards_done IS NULL "
                                 "AND shard_plan IS NULL")).scalar_one() == 2
        for i in range(3):
            conn.execute(text("INSERT INTO comparison_shards (id, comparison_id, \"index\", start, stop, tensor_bytes, "
                              "status, attempts, created_at, results) VALUES (:id, 'c1', :i, :a, :b, 1, 'done', 1, :t, "
                              ":r)"), {"id": f"c1:{i}", "i": i, "a": 10 * i, "b": 10 * i + 10, "t": now, "r": b"\x00\xff"})
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql("PRAGMA foreign_keys=ON")
        conn.execute(text("DELETE FROM comparisons WHERE id = 'c2'"))
        assert conn.execute(text("SELECT count(*) FROM comparison_shards")).scalar_one() == 3
        conn.execute(text("DELETE FROM comparisons WHERE id = 'c1'"))
        assert conn.execute(text("SELECT count(*) FROM comparison_shards")).scalar_one() == 0, "shards go with it"
        conn.execute(text("INSERT INTO comparisons (id, project_id, reference_id, target_id, mode, status, counts, "
                          "unmatched, attempts, created_at, shards, shards_done) VALUES ('c3', 1, 'b', 'b', "
                          "'propagated', 'running', '{}', 0, 1, :t, 4, 2)"), {"t": now})
    engine.dispose()
    downgrade(database_url, "0004_i11d")
    assert "comparison_shards" not in tables(database_url)
    engine = make_engine(database_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM comparisons")).scalar_one() == 1
    assert "shards" not in {c["name"] for c in inspect(engine).get_columns("comparisons")}
    engine.dispose()
    upgrade(database_url)
