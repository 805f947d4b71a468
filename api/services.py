"""What a running service holds: settings, database, blob store, worker pool. Made once per process."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import func, select, text

from api.store.db import Database, check_schema
from api.errors import Unavailable
from api.jobs.comparisons import WorkerPool
from api.store.models import Comparison
from api.settings import Settings
from api.store.blobs import BlobStore, store_from_settings


@dataclass
class Services:
    settings: Settings
    db: Database
    store: BlobStore
    workers: WorkerPool

    @classmethod
    def open(cls, settings: Settings) -> Services:
        db = Database(settings)
        check_schema(db.engine)
        store = store_from_settings(settings)
        return cls(settings, db, store, WorkerPool(db, store, settings))

    @property
    def upload_temp_dir(self) -> Path:
        temp = getattr(self.store, "temp_dir", None)
        return temp() if temp else self.settings.data_dir / "tmp"

    def disk_folders(self) -> list[Path]:
        """Local folders the service writes to: the data dir and the upload temp folder (a local store's)."""
        folders = [self.settings.data_dir, self.upload_temp_dir]
        return [f for f in folders if f.exists()]

    def readiness(self) -> dict[str, str | int]:
        """Check database (and its schema), blob store and job queue; raise Unavailable naming the one that failed."""
        try:
            with self.db.session() as s:
                s.execute(text("SELECT 1"))
                pending = s.scalar(select(func.count()).where(Comparison.status == "pending")) or 0
            check_schema(self.db.engine)
        except Exception as e:  # noqa: BLE001 - readiness reports, it does not crash
            raise Unavailable(f"not ready: database: {type(e).__name__}: {e}") from e
        try:
            self.store.check()
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"not ready: blob store {self.settings.effective_store_url}: {type(e).__name__}: {e}") from e
        for folder in self.disk_folders():
            free = shutil.disk_usage(folder).free
            if free < self.settings.min_free_bytes:
                raise Unavailable(f"not ready: disk: {free} bytes free under {folder}, below OPBAND_MIN_FREE_BYTES "
                                  f"({self.settings.min_free_bytes}): free space (`opband gc`, retention) or add disk")
        if self.settings.runs_jobs_in_process and not self.workers.alive():
            raise Unavailable("not ready: queue: the in-process comparison workers have stopped")
        return {"status": "ready", "database": self.db.engine.dialect.name, "store": type(self.store).__name__,
                "queue": self.settings.queue, "in_process_workers": self.workers.alive(), "pending_jobs": pending}

    def close(self) -> None:
        self.workers.stop()
        self.db.dispose()
