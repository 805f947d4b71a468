"""Upload: stream the body to a temp file while hashing, validate, then store row + blob together."""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import shutil
import struct
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from accuracy.bundle import Bundle
from accuracy.gcpause import paused_gc
from accuracy.errors import BundleError
from accuracy.manifest import Record, RunNames
from api.store.db import Database
from api.errors import InvalidInput, RequestTimeout, TooLarge, Unavailable
from api.store.maintenance import PARTIAL_SUFFIX, partial_prefix
from api.store.models import BundleRow, OpRecordRow, Project
from api.observability import UPLOAD_BYTES
from api.store.blobs import BlobStore


class SpooledUpload:
    """A streamed request body on disk, with its sha256 and size."""

    def __init__(self, path: Path, sha256: str, size: int) -> None:
        self.path, self.sha256, self.size = path, sha256, size

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


async def spool(body: AsyncIterator[bytes], temp_dir: Path, limit: int, declared: int | None,
                idle_seconds: float = 30.0, min_free_bytes: int = 0) -> SpooledUpload:
    """Write ``body`` to a temp file chunk by chunk; never holds the whole body in memory.

    A body that sends nothing for ``idle_seconds`` is dropped (408); one that would leave less than
    ``min_free_bytes`` free on the temp folder's disk is refused before it is read (503).
    """
    if declared is not None and declared > limit:
        raise TooLarge(f"bundle is {declared} bytes; this server accepts at most {limit} (OPBAND_MAX_UPLOAD_BYTES)")
    temp_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(temp_dir).free
    if free - (declared or 0) < min_free_bytes:
        raise Unavailable(f"the server's disk is almost full ({free} bytes free, OPBAND_MIN_FREE_BYTES is "
                          f"{min_free_bytes}): try again later; operators: free space or run `opband gc`")
    fd, name = tempfile.mkstemp(prefix=partial_prefix(), suffix=PARTIAL_SUFFIX, dir=temp_dir)
    path = Path(name)
    digest = hashlib.sha256()
    size = 0
    chunks = body.__aiter__()
    try:
        with os.fdopen(fd, "wb") as f:
            while True:
                try:
                    chunk = await asyncio.wait_for(chunks.__anext__(), idle_seconds)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise RequestTimeout(f"the upload sent nothing for {idle_seconds:g} s after {size} bytes "
                                         "(OPBAND_UPLOAD_IDLE_SECONDS): send it again") from None
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


@dataclass(frozen=True)
class IngestLimits:
    """What one bundle may cost the server (Settings.max_manifest_bytes, max_records)."""

    max_manifest_bytes: int = 1 << 30
    max_records: int = 2_000_000


_SPLIT = "split the capture (--module/--op filters, fewer steps, or summary mode, which stores no tensors)"


def check_header_size(path: Path, limit: int) -> None:
    """Refuse (413) a bundle whose header (tensor table and manifest) is over ``limit`` bytes, before
    parsing it."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        if limit < n <= path.stat().st_size - 8:  # a length past the file's end is no bundle at all: the parser says so
            raise TooLarge(f"the bundle's header (tensor table and manifest) is {n:,} bytes; this server reads at "
                           f"most {limit:,} of manifest and records (OPBAND_MAX_MANIFEST_BYTES): {_SPLIT}")


def check_records_size(path: Path, limits: IngestLimits) -> int:
    """Refuse (413) a bundle that says it holds more than ``max_records`` records, or whose header and
    records (the JSON the server validates; format 2.0 keeps records out of the header) are over
    ``max_manifest_bytes``, before reading a record. Returns the record count."""
    try:
        count, record_bytes, header_bytes = Bundle.peek_records(path)
    except BundleError as e:
        raise InvalidInput(f"not a valid opband bundle: {e}") from e
    if count > limits.max_records:
        raise TooLarge(f"the bundle has {count:,} records; this server takes at most {limits.max_records:,} per "
                       f"bundle (OPBAND_MAX_RECORDS): {_SPLIT}")
    if header_bytes + record_bytes > limits.max_manifest_bytes:
        raise TooLarge(f"the bundle's manifest and records are {header_bytes + record_bytes:,} bytes; this server "
                       f"reads at most {limits.max_manifest_bytes:,} (OPBAND_MAX_MANIFEST_BYTES): {_SPLIT}")
    return count


#: op_records rows written per INSERT: bounded memory for bundles of any record count
INSERT_BATCH = 5000
#: the indexed fields of a record, in the order of the lines ``inspect_bundle`` writes
RECORD_COLUMNS = ("key", "output", "op", "module", "kind", "index", "shape_signature", "dtype")


@dataclass(frozen=True)
class Inspected:
    """What the server keeps of a valid bundle, besides its records (streamed from ``records_path``)."""

    run: dict[str, Any]
    environment: dict[str, Any]
    variant: str
    device: str
    records: int
    names: RunNames


@paused_gc()  # a child process (``isolate``) in the server: a Record per line, no cycles
def inspect_bundle(path: Path, records_path: Path, limits: IngestLimits, names: RunNames | None = None) -> Inspected:
    """Open and validate a bundle and write its records' indexed fields to ``records_path`` (one JSON
    array per line), streaming them: memory stays flat in the number of records (a format 1.x manifest,
    which holds its records, costs memory in proportion: :func:`store_bundle` runs this in a short-lived
    child process, so that cost never stays in, or grows, the server)."""
    check_header_size(path, limits.max_manifest_bytes)
    check_records_size(path, limits)
    try:
        bundle = Bundle.open(path)
    except BundleError as e:
        raise InvalidInput(f"not a valid opband bundle: {e}") from e
    m = bundle.manifest
    check_no_nul({"run": m.run, "environment": m.environment})
    try:
        named = m.names_with(names)
    except BundleError as e:
        raise InvalidInput(f"{e}; fix it at capture (--target, --tag) or override it at upload") from e
    count = 0
    with open(records_path, "w") as f:
        for r in check_record_fields(bundle.iter_records()):
            f.write(json.dumps([r.key, r.output, r.op, r.module, r.kind, r.index, r.shape_signature[:1000], r.dtype]))
            f.write("\n")
            count += 1
    return Inspected(m.run, m.environment, m.variant, m.device, count, named)


_POOL_LOCK = threading.Lock()


def _inspect_in_child(path: Path, records_path: Path, limits: IngestLimits, names: RunNames | None) -> Inspected:
    """:func:`inspect_bundle` in a fresh child process (forkserver: no copy of the server's state), which
    exits afterwards and returns its memory. Errors come back as the same exceptions."""
    with _POOL_LOCK:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["api.store.ingest"])
    with ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=1) as pool:
        try:
            return pool.submit(inspect_bundle, path, records_path, limits, names).result()
        except BrokenProcessPool:
            raise Unavailable("validating the bundle ran out of memory or was killed: try again later; operators: "
                              "lower OPBAND_MAX_MANIFEST_BYTES / OPBAND_MAX_RECORDS or add memory") from None


def _record_batches(records_path: Path, bundle_id: str) -> Iterator[list[dict[str, Any]]]:
    with open(records_path) as f:
        batch: list[dict[str, Any]] = []
        for line in f:
            batch.append({"bundle_id": bundle_id, **dict(zip(RECORD_COLUMNS, json.loads(line)))})
            if len(batch) == INSERT_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch


def store_bundle(db: Database, store: BlobStore, project: Project | Callable[[], Project], upload: SpooledUpload,
                 names: RunNames | None = None, limits: IngestLimits | None = None,
                 isolate: bool = True) -> tuple[BundleRow, bool]:
    """Validate and store an upload; returns (row, created). Same bytes again return the same row (with
    the names it was first stored under). ``names`` given at upload override the manifest's.

    ``project`` may be a function that makes it: it is called only once the bundle is valid, so an
    invalid upload creates nothing. The bundle is parsed in a child process (``isolate``) and its
    records inserted in batches: the server's memory does not grow with the record count. The blob is
    written first, the row committed second; if the commit fails the blob is removed, so no failure
    leaves a row without its blob; a crash in between leaves an orphan blob that ``opband gc`` removes.
    """
    limits = limits or IngestLimits()
    records_path = upload.path.with_name(upload.path.name + ".records" + PARTIAL_SUFFIX)
    try:
        if isinstance(project, Project):
            existing = _find(db, project.id, upload.sha256)
            if existing is not None:
                return existing, False
        found = (_inspect_in_child if isolate else inspect_bundle)(upload.path, records_path, limits, names)
        run, env = found.run, found.environment
        variant, device = _text(found.variant, 40) or "fp32", _text(found.device, 100) or "cpu"
        if not isinstance(project, Project):
            project = project()
            existing = _find(db, project.id, upload.sha256)
            if existing is not None:
                return existing, False
        row = BundleRow(
            id=uuid.uuid4().hex, project_id=project.id, sha256=upload.sha256, size=upload.size,
            storage_key=f"{project.name}/{upload.sha256}.bundle", label=found.names.label,
            variant=variant, device=device, target=found.names.target_or_default(variant, device)[:200],
            tags=found.names.tags,
            level=_text(run.get("level"), 20), mode=_text(run.get("mode"), 20),
            git_commit=_text(env.get("git_commit"), 64), git_branch=_text(env.get("git_branch"), 200),
            records=found.records, run=run, environment=env,
        )
        store.put_file(row.storage_key, upload.path)
        try:
            with db.session() as s:
                s.add(row)
                s.flush()
                for batch in _record_batches(records_path, row.id):
                    s.execute(insert(OpRecordRow), batch)
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
        records_path.unlink(missing_ok=True)


#: record fields stored in indexed columns, and their column widths (api/store/models.py)
RECORD_LIMITS = {"key": 1000, "module": 800, "op": 200, "dtype": 40}


def check_record_fields(records: Iterable[Record]) -> Iterator[Record]:
    """The records, each checked as it passes: refuse (422) one whose indexed fields would not fit their
    columns or hold a NUL, naming it."""
    for r in records:
        for name, limit in RECORD_LIMITS.items():
            value = getattr(r, name)
            if len(value) > limit:
                raise InvalidInput(f"record {r.key[:80]!r}: {name} is {len(value)} characters; this server indexes "
                                   f"at most {limit}. Shorten module names or filter the capture (--module/--op)")
            if "\x00" in value:
                raise InvalidInput(f"record {r.key[:80]!r}: {name} contains a NUL character, which no database "
                                   "column can hold: fix the capture's names")
        if "\x00" in r.shape_signature:
            raise InvalidInput(f"record {r.key[:80]!r}: its input shapes contain a NUL character")
        yield r


def check_no_nul(value: object, where: str = "") -> None:
    """Refuse (422) free-form metadata holding a NUL character anywhere (PostgreSQL stores none)."""
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidInput(f"manifest field {where or '(root)'} contains a NUL character: remove it")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_no_nul(k, where)
            check_no_nul(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_no_nul(v, f"{where}[{i}]")


def _text(value: object, limit: int) -> str | None:
    """Free-form manifest metadata (run/environment) as a bounded string column value."""
    if value is None or value == "":
        return None
    return str(value)[:limit]


def _find(db: Database, project_id: int, sha256: str) -> BundleRow | None:
    with db.session() as s:
        return s.scalar(select(BundleRow).where(BundleRow.project_id == project_id, BundleRow.sha256 == sha256))
