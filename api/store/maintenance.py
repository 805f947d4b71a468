"""Keeping the store clean: stale upload temp files, orphan blobs and rows (``opband gc``)."""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import delete, or_, select

from api.store.blobs import BlobStore
from api.store.db import Database
from api.store.models import BundleRow, Comparison

log = logging.getLogger("opband.maintenance")
PARTIAL_SUFFIX = ".partial"


def partial_prefix() -> str:
    """Upload temp files name the process writing them (``upload-<pid>@<host>-``), so a restart can tell
    the files of a dead process from those of a live upload in another process or replica."""
    return f"upload-{os.getpid()}@{socket.gethostname()}-"


def _writer_is_dead(name: str) -> bool:
    if not name.startswith("upload-") or "@" not in name:
        return False
    pid, _, rest = name.removeprefix("upload-").partition("@")
    host = rest.rsplit("-", 1)[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def sweep_partials(temp_dir: Path, stale_seconds: float) -> int:
    """Remove upload temp files left by a crash: those of a dead process on this host, and any that
    nothing wrote to for ``stale_seconds`` (a live upload idle that long has been dropped already).
    Returns how many were removed."""
    if not temp_dir.is_dir():
        return 0
    removed, now = 0, time.time()
    for path in temp_dir.glob(f"upload-*{PARTIAL_SUFFIX}"):
        try:
            if _writer_is_dead(path.name) or now - path.stat().st_mtime > stale_seconds:
                path.unlink()
                removed += 1
        except FileNotFoundError:  # finished or removed meanwhile
            continue
    if removed:
        log.info("removed stale partial uploads", extra={"count": removed, "folder": str(temp_dir)})
    return removed


@dataclass
class GcReport:
    """What ``opband gc`` found (and, unless a dry run, removed)."""

    orphan_blobs: list[str] = field(default_factory=list)
    rows_without_blob: list[str] = field(default_factory=list)
    comparisons_removed: list[str] = field(default_factory=list)
    partials: int = 0
    applied: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"orphan_blobs": self.orphan_blobs, "rows_without_blob": self.rows_without_blob,
                "comparisons_removed": self.comparisons_removed, "partials": self.partials,
                "applied": self.applied}


def gc(db: Database, store: BlobStore, apply: bool = False, grace_seconds: float = 600,
       temp_dir: Path | None = None, stale_seconds: float = 3600) -> GcReport:
    """Find blobs no bundle row names and bundle rows whose blob is gone; remove them when ``apply``.

    Blobs younger than ``grace_seconds`` are left alone (an upload stores its blob a moment before its
    row commits). A bundle row without its blob cannot be compared: it goes, with the comparisons of it.
    """
    report = GcReport(applied=apply)
    with db.session() as s:
        known = {k for (k,) in s.execute(select(BundleRow.storage_key))}
        rows = s.execute(select(BundleRow.id, BundleRow.storage_key)).all()
    now = time.time()
    stored = set()
    for key, modified in store.keys():
        stored.add(key)
        if key not in known and now - modified > grace_seconds:
            report.orphan_blobs.append(key)
    report.rows_without_blob = [bid for bid, key in rows if key not in stored]
    if report.rows_without_blob:
        with db.session() as s:
            report.comparisons_removed = list(s.scalars(select(Comparison.id).where(or_(
                Comparison.reference_id.in_(report.rows_without_blob),
                Comparison.target_id.in_(report.rows_without_blob)))))
    if apply:
        for key in report.orphan_blobs:
            store.delete(key)
        with db.session() as s:
            if report.comparisons_removed:
                s.execute(delete(Comparison).where(Comparison.id.in_(report.comparisons_removed)))
            if report.rows_without_blob:
                s.execute(delete(BundleRow).where(BundleRow.id.in_(report.rows_without_blob)))
    if temp_dir is not None:
        report.partials = sweep_partials(temp_dir, stale_seconds) if apply else sum(
            1 for p in temp_dir.glob(f"upload-*{PARTIAL_SUFFIX}") if _writer_is_dead(p.name)
            or now - p.stat().st_mtime > stale_seconds) if temp_dir.is_dir() else 0
    return report
