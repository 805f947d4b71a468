"""What a running service holds: settings, database, blob store, worker pool. Made once per process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from api.db import Database, check_schema
from api.jobs import WorkerPool
from api.settings import Settings
from api.store import BlobStore, make_store


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
        store = make_store(settings.effective_store_url, settings.s3_endpoint_url)
        return cls(settings, db, store, WorkerPool(db, store, settings))

    @property
    def upload_temp_dir(self) -> Path:
        temp = getattr(self.store, "temp_dir", None)
        return temp() if temp else self.settings.data_dir / "tmp"

    def close(self) -> None:
        self.workers.stop()
        self.db.dispose()
