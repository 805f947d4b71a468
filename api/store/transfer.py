"""Export a project (its rows and blobs) to one tar file, and import it into any database and store:
a backup of one project, or a move from SQLite to PostgreSQL. Tokens are not exported (only their
hashes exist); create new ones after an import."""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, Table, insert, select

from api.errors import Conflict, InvalidInput, NotFound
from api.store.blobs import BlobStore
from api.store.db import Database
from api.store.models import (
    AcceptedDeviation, Baseline, BaselineMember, BundleRow, Comparison, OpRecordRow, OpResultRow, Project, Regression,
    RegressionEvent, Series,
)

FORMAT = "opband.export/1"
BATCH = 2000

#: exported tables in dependency order, how their rows belong to the project, the integer ids an import
#: renumbers (table name -> its id column), and the columns that point at renumbered ids
TABLES: list[tuple[Any, str, bool, dict[str, str]]] = [
    # (model, how rows belong to the project, renumber own id, {column: table whose new id it takes})
    (BundleRow, "project", False, {}),
    (OpRecordRow, "bundle", True, {}),
    (Comparison, "project", False, {}),
    (Series, "project", True, {}),
    (OpResultRow, "comparison", True, {"series_id": "series"}),
    (Baseline, "project", True, {}),
    (BaselineMember, "baseline", False, {"baseline_id": "baselines"}),
    (AcceptedDeviation, "project", True, {}),
    (Regression, "project", True, {"series_id": "series", "accepted_by": "accepted_deviations"}),
    (RegressionEvent, "project", True, {"regression_id": "regressions", "deviation_id": "accepted_deviations"}),
]
#: tables whose new ids other rows need (the others' ids are just dropped and made anew)
_REFERENCED = {"series", "baselines", "accepted_deviations", "regressions"}


def _rows(db: Database, model: Any, owner: str, project_id: int) -> Iterator[dict[str, Any]]:
    table: Table = model.__table__
    q = select(table)
    if owner == "project":
        q = q.where(table.c.project_id == project_id)
    elif owner == "bundle":
        q = q.where(table.c.bundle_id.in_(select(BundleRow.id).where(BundleRow.project_id == project_id)))
    elif owner == "comparison":
        q = q.where(table.c.comparison_id.in_(select(Comparison.id).where(Comparison.project_id == project_id)))
    elif owner == "baseline":
        q = q.where(table.c.baseline_id.in_(select(Baseline.id).where(Baseline.project_id == project_id)))
    with db.engine.connect() as conn:
        for row in conn.execution_options(yield_per=BATCH).execute(q).mappings():
            yield dict(row)


def _encode(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def export_project(db: Database, store: BlobStore, name: str, out: Path) -> dict[str, int]:
    """Write project ``name`` to ``out`` (a tar file): rows as JSON lines per table, blobs by sha256."""
    with db.session() as s:
        project = s.scalar(select(Project).where(Project.name == name))
    if project is None:
        raise NotFound(f"project {name!r} does not exist")
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="opband-export-") as tmp, tarfile.open(out, "w") as tar:
        for model, owner, _, _ in TABLES:
            path = Path(tmp) / f"{model.__tablename__}.jsonl"
            n = 0
            with open(path, "w") as f:
                for row in _rows(db, model, owner, project.id):
                    f.write(json.dumps({k: _encode(v) for k, v in row.items()}) + "\n")
                    n += 1
            counts[model.__tablename__] = n
            tar.add(path, arcname=f"rows/{path.name}")
        for row in _rows(db, BundleRow, "project", project.id):
            info = tarfile.TarInfo(f"blobs/{row['sha256']}.bundle")
            info.size = row["size"]
            with store.open(row["storage_key"]) as blob:
                tar.addfile(info, blob)
        head = json.dumps({"format": FORMAT, "project": {"name": project.name, "public": project.public,
                                                          "created_at": project.created_at.isoformat()},
                           "counts": counts}).encode()
        meta = Path(tmp) / "export.json"
        meta.write_bytes(head)
        tar.add(meta, arcname="export.json")
    return counts


def _decode(table: Table, row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        column = table.c.get(key)
        if column is None:
            continue  # a column this version does not have
        out[key] = datetime.fromisoformat(value) if value is not None and isinstance(column.type, DateTime) else value
    return out


def import_project(db: Database, store: BlobStore, source: Path, rename: str | None = None) -> dict[str, int]:
    """Load an export into this database and store as a new project (``rename`` or its exported name)."""
    try:
        tar = tarfile.open(source, "r")
    except (OSError, tarfile.TarError) as e:
        raise InvalidInput(f"{source} is not an opband export: {e}") from e
    with tar, tempfile.TemporaryDirectory(prefix="opband-import-") as tmp:
        members = {m.name: m for m in tar.getmembers() if m.isfile() and ".." not in m.name and not m.name.startswith("/")}
        if "export.json" not in members:
            raise InvalidInput(f"{source} has no export.json: not an opband export")
        head = json.loads(tar.extractfile(members["export.json"]).read())  # type: ignore[union-attr]
        if head.get("format") != FORMAT:
            raise InvalidInput(f"{source} is format {head.get('format')!r}; this opband reads {FORMAT}")
        name = rename or head["project"]["name"]
        with db.session() as s:
            if s.scalar(select(Project.id).where(Project.name == name)) is not None:
                raise Conflict(f"project {name!r} exists already: import under another name (--as NAME)")
            project = Project(name=name, public=head["project"]["public"],
                              created_at=datetime.fromisoformat(head["project"]["created_at"]))
            s.add(project)
            s.flush()
            new_ids: dict[str, dict[Any, Any]] = {t: {} for t in _REFERENCED}
            counts = {}
            for model, _, renumber, refs in TABLES:
                table: Table = model.__table__
                member = members.get(f"rows/{table.name}.jsonl")
                lines = tar.extractfile(member) if member else None
                batch: list[dict[str, Any]] = []
                n = 0
                for line in lines or []:
                    row = _decode(table, json.loads(line))
                    if "project_id" in row:
                        row["project_id"] = project.id
                    if table.name == "bundles":
                        row["storage_key"] = f"{name}/{row['sha256']}.bundle"
                    for column, target in refs.items():
                        if row.get(column) is not None:
                            row[column] = new_ids[target].get(row[column])
                    old = row.pop("id", None) if renumber else None
                    n += 1
                    if table.name in _REFERENCED:  # one at a time: the new id is needed by later rows
                        new_ids[table.name][old] = s.execute(insert(table).values(**row).returning(table.c.id)).scalar_one()
                        continue
                    batch.append(row)
                    if len(batch) == BATCH:
                        s.execute(insert(table), batch)
                        batch = []
                if batch:
                    s.execute(insert(table), batch)
                counts[table.name] = n
            for row in s.execute(select(BundleRow.sha256, BundleRow.storage_key).where(BundleRow.project_id == project.id)):
                member = members.get(f"blobs/{row.sha256}.bundle")
                if member is None:
                    raise InvalidInput(f"{source} lacks the blob of bundle {row.sha256}: the export is incomplete")
                path = Path(tmp) / f"{row.sha256}.bundle"
                with tar.extractfile(member) as src, open(path, "wb") as dst:  # type: ignore[union-attr]
                    shutil.copyfileobj(src, dst, 1 << 20)
                store.put_file(row.storage_key, path)  # a failure rolls the rows back; gc removes stray blobs
    return counts
