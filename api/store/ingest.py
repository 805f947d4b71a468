"""Upload: stream the body to a temp file while hashing, validate, then store row + blob together."""

from __future__ import annotations

import hashlib
import os
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from accuracy.bundle import Bundle
from accuracy.errors import BundleError
from accuracy.manifest import Record, RunNames
from api.store.db import Database
from api.errors import InvalidInput, TooLarge
from api.store.models import BundleRow, OpRecordRow, Project
from api.observability import UPLOAD_BYTES
from api.store.blobs import BlobStore


class SpooledUpload:
    """A streamed request body on disk, with its sha256 and size."""

    def __init__(self, path: Path, sha256: str, size: int) -> None:
        self.path, self.sha256, self.size = path, sha256, size

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


async def spool(body: AsyncIterator[bytes], temp_dir: Path, limit: int, declared: int | None) -> SpooledUpload:
    """Write ``body`` to a temp file chunk by chunk; never holds the whole body in memory."""
    if declared is not None and declared > limit:
        raise TooLarge(f"bundle is {declared} bytes; this server accepts at most {limit} (OPBAND_MAX_UPLOAD_BYTES)")
    temp_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix="upload-", suffix=".partial", dir=temp_dir)
    path = Path(name)
    digest = hashlib.sha256()
    size = 0
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in body:
                size += len(chunk)
                UPLOAD_BYTES.inc(len(chunk))
                if size > limit:
                    raise TooLarge(f"bundle exceeds this server's limit of {limit} bytes (OPBAND_MAX_UPLOAD_BYTES)")
                digest.update(chunk)
                f.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    if declared is not None and declared != size:
        path.unlink(missing_ok=True)
        raise InvalidInput(f"body is {size} bytes but Content-Length said {declared}: upload truncated, send it again")
    if size == 0:
        path.unlink(missing_ok=True)
        raise InvalidInput("empty body: send the bundle file's bytes (opband upload BUNDLE --server URL --project P)")
    return SpooledUpload(path, digest.hexdigest(), size)


def store_bundle(db: Database, store: BlobStore, project: Project, upload: SpooledUpload,
                 names: RunNames | None = None) -> tuple[BundleRow, bool]:
    """Validate and store an upload; returns (row, created). Same bytes again return the same row
    (with the names it was first stored under). ``names`` given at upload override the manifest's.

    The blob is written first, the row committed second; if the commit fails the blob is removed,
    so no failure leaves a row without its blob or (beyond a crash) a blob without its row.
    """
    try:
        existing = _find(db, project.id, upload.sha256)
        if existing is not None:
            return existing, False
        try:
            bundle = Bundle.open(upload.path)
        except BundleError as e:
            raise InvalidInput(f"not a valid opband bundle: {e}") from e
        m = bundle.manifest
        check_record_fields(m.records)
        run, env = m.run, m.environment
        try:
            named = m.names_with(names)
        except BundleError as e:
            raise InvalidInput(f"{e}; fix it at capture (--target, --tag) or override it at upload") from e
        variant, device = _text(m.variant, 40) or "fp32", _text(m.device, 100) or "cpu"
        row = BundleRow(
            id=uuid.uuid4().hex, project_id=project.id, sha256=upload.sha256, size=upload.size,
            storage_key=f"{project.name}/{upload.sha256}.bundle", label=named.label,
            variant=variant, device=device, target=named.target_or_default(variant, device)[:200], tags=named.tags,
            level=_text(run.get("level"), 20), mode=_text(run.get("mode"), 20),
            git_commit=_text(env.get("git_commit"), 64), git_branch=_text(env.get("git_branch"), 200),
            records=len(m.records), run=run, environment=env,
        )
        records = [
            OpRecordRow(bundle_id=row.id, key=r.key, output=r.output, op=r.op, module=r.module, kind=r.kind,
                        index=r.index, shape_signature=r.shape_signature[:1000], dtype=r.dtype)
            for r in m.records
        ]
        del bundle
        store.put_file(row.storage_key, upload.path)
        try:
            with db.session() as s:
                s.add(row)
                s.flush()
                s.add_all(records)
        except IntegrityError:
            # a concurrent upload of the same bytes won the race: theirs stands, and shares our blob key
            winner = _find(db, project.id, upload.sha256)
            if winner is None:
                store.delete(row.storage_key)
                raise
            return winner, False
        except BaseException:
            store.delete(row.storage_key)
            raise
        return row, True
    finally:
        upload.discard()


#: record fields stored in indexed columns, and their column widths (api/store/models.py)
RECORD_LIMITS = {"key": 1000, "module": 800, "op": 200, "dtype": 40}


def check_record_fields(records: list[Record]) -> None:
    """Refuse (422) a record whose indexed fields would not fit their columns, naming it."""
    for r in records:
        for name, limit in RECORD_LIMITS.items():
            value = getattr(r, name)
            if len(value) > limit:
                raise InvalidInput(f"record {r.key[:80]!r}: {name} is {len(value)} characters; this server indexes "
                                   f"at most {limit}. Shorten module names or filter the capture (--module/--op)")


def _text(value: object, limit: int) -> str | None:
    """Free-form manifest metadata (run/environment) as a bounded string column value."""
    if value is None or value == "":
        return None
    return str(value)[:limit]


def _find(db: Database, project_id: int, sha256: str) -> BundleRow | None:
    with db.session() as s:
        return s.scalar(select(BundleRow).where(BundleRow.project_id == project_id, BundleRow.sha256 == sha256))
