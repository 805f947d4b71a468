"""Operating the service's storage: ``opband db``, ``opband token``, ``opband gc`` and ``opband project``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from opband.cli_common import DataDir, fail, open_db, settings_from_flags


def _store(settings):  # type: ignore[no-untyped-def]
    from api.store.blobs import store_from_settings

    return store_from_settings(settings)


def db_upgrade(data_dir: DataDir = Path(".opband"), revision: str = "head") -> None:
    """Migrate the database (OPBAND_DATABASE_URL or the data dir's SQLite) to the latest schema."""
    from sqlalchemy.exc import DBAPIError

    from api.store.db import upgrade as run

    settings = settings_from_flags(data_dir=data_dir)
    where = settings.effective_database_url.split("@")[-1]
    try:
        run(settings.effective_database_url, revision)
    except DBAPIError as e:
        first = str(e.orig or e).strip().splitlines()[0][:300]
        fail(f"cannot migrate the database {where}: {first}. Is it running and reachable, and are "
             "OPBAND_DATABASE_URL and its credentials right? Nothing was changed")
    typer.echo(f"database at {revision}: {where}")


def db_downgrade(revision: Annotated[str, typer.Argument(help="the revision to go back to, e.g. 0003")],
                 data_dir: DataDir = Path(".opband")) -> None:
    """Migrate the database back to REVISION (before running an older opband); the data is kept."""
    from sqlalchemy.exc import DBAPIError

    from api.store.db import downgrade as run

    settings = settings_from_flags(data_dir=data_dir)
    where = settings.effective_database_url.split("@")[-1]
    try:
        run(settings.effective_database_url, revision)
    except DBAPIError as e:
        fail(f"cannot migrate the database {where}: {str(e.orig or e).strip().splitlines()[0][:300]}")
    typer.echo(f"database at {revision}: {where}")


def token_create(
    project: Annotated[str, typer.Option(help="project the token is for (created if missing)")],
    read_only: Annotated[bool, typer.Option("--read-only", metavar="", help="may read, not write")] = False,
    name: Annotated[Optional[str], typer.Option(help="a label to recognise it by")] = None,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Create a project token and print it once (only its hash is stored)."""
    from api.auth import create_token

    db = open_db(settings_from_flags(data_dir=data_dir))
    typer.echo(create_token(db, project, read_only=read_only, name=name))


def token_list(
    project: Annotated[Optional[str], typer.Option(help="only this project's tokens")] = None,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """List tokens (id, project, read-only, name, created); the secrets themselves are never stored."""
    from rich.console import Console
    from rich.table import Table

    from api.auth import list_tokens

    db = open_db(settings_from_flags(data_dir=data_dir))
    table = Table("id", "project", "access", "name", "created")
    for tok, name in list_tokens(db, project):
        table.add_row(str(tok.id), name, "read-only" if tok.read_only else "write", tok.name or "",
                      tok.created_at.strftime("%Y-%m-%d %H:%M"))
    Console().print(table)


def token_revoke(
    token_id: Annotated[int, typer.Argument(help="the id `opband token list` shows")],
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Revoke a token: requests with it get 401 from now on."""
    from api.auth import revoke_token

    if not revoke_token(open_db(settings_from_flags(data_dir=data_dir)), token_id):
        fail(f"no token with id {token_id}: see `opband token list`")
    typer.echo(f"token {token_id} revoked")


def gc(
    apply: Annotated[bool, typer.Option("--apply", metavar="", help="remove what is found (default: only report)")] = False,
    grace_seconds: Annotated[float, typer.Option(help="leave blobs younger than this (uploads in flight)")] = 600,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Find blobs no bundle names, bundles whose blob is gone and stale upload temp files; --apply removes them."""
    from api.store.maintenance import gc as run_gc

    settings = settings_from_flags(data_dir=data_dir)
    store = _store(settings)
    temp = getattr(store, "temp_dir", None)
    report = run_gc(open_db(settings), store, apply=apply, grace_seconds=grace_seconds,
                    temp_dir=temp() if temp else None, stale_seconds=max(2 * settings.upload_idle_seconds, 60))
    typer.echo(json.dumps(report.as_dict(), indent=2))
    if not apply and (report.orphan_blobs or report.rows_without_blob or report.partials):
        typer.echo("dry run: nothing removed; run again with --apply to remove these", err=True)


def project_export(
    name: Annotated[str, typer.Argument(help="the project")],
    out: Annotated[Path, typer.Option("-o", "--out", help="the export file to write (a tar)")],
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Write a project's rows and blobs to one file (tokens are not exported: create new ones after import)."""
    from api.errors import ServiceError
    from api.store.transfer import export_project

    settings = settings_from_flags(data_dir=data_dir)
    try:
        counts = export_project(open_db(settings), _store(settings), name, out)
    except ServiceError as e:
        fail(str(e))
    typer.echo(json.dumps({"project": name, "file": str(out), "rows": counts}, indent=2))


def project_import(
    source: Annotated[Path, typer.Argument(help="a file from `opband project export`")],
    rename: Annotated[Optional[str], typer.Option("--as", help="import under this name")] = None,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Load an exported project into this database and blob store (run `opband db upgrade` first)."""
    from api.errors import ServiceError
    from api.store.transfer import import_project

    settings = settings_from_flags(data_dir=data_dir)
    try:
        counts = import_project(open_db(settings), _store(settings), source, rename)
    except ServiceError as e:
        fail(str(e))
    typer.echo(json.dumps({"file": str(source), "rows": counts}, indent=2))


def project_retention(
    name: Annotated[str, typer.Argument(help="the project")],
    keep_runs: Annotated[int, typer.Option(min=0, help="per target name, keep the newest this many comparisons")] = 50,
    keep_days: Annotated[float, typer.Option(min=0, help="and everything younger than this")] = 90,
    apply: Annotated[bool, typer.Option("--apply", metavar="", help="delete (default: only report)")] = False,
    data_dir: DataDir = Path(".opband"),
) -> None:
    """Let old comparisons and bundles go; never what a baseline holds or a regression names."""
    from api.store.retention import retention

    settings = settings_from_flags(data_dir=data_dir)
    db = open_db(settings)
    project = _project(db, name)
    typer.echo(json.dumps(retention(db, _store(settings), project, keep_runs, keep_days, apply).as_dict(), indent=2))


def _project(db, name: str):  # type: ignore[no-untyped-def]
    """The project row named ``name``, or exit 2 saying it does not exist."""
    from sqlalchemy import select

    from api.store.models import Project

    with db.session() as s:
        project = s.scalar(select(Project).where(Project.name == name))
    if project is None:
        fail(f"project {name!r} does not exist")
    return project
