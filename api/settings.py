"""One settings object (``OPBAND_`` environment prefix), read once and passed down."""

from __future__ import annotations

import ipaddress
from functools import cached_property
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


QUEUES = ("embedded", "database")


class Settings(BaseSettings):
    """Service configuration. Defaults are the embedded setup: SQLite + a folder in ``data_dir``."""

    model_config = SettingsConfigDict(env_prefix="OPBAND_", extra="ignore")

    data_dir: Path = Field(default=Path(".opband"), description="where the embedded database and blobs live")
    database_url: str | None = Field(default=None, description="SQLAlchemy URL; default sqlite:///<data_dir>/opband.db")
    store_url: str | None = Field(default=None, description="blob store: a folder path, file://, or s3://bucket/prefix")
    s3_endpoint_url: str | None = Field(default=None, description="endpoint of an S3-compatible store (MinIO, moto)")
    queue: str = Field(default="embedded", description=(
        "'embedded': the API process runs jobs in OPBAND_WORKERS threads; 'database': only `opband worker` "
        "processes run them (the API never does). Both claim rows of the comparisons table with a lease"))
    workers: int = Field(default=2, ge=0, description="in-process comparison workers (queue=embedded; 0 = none)")
    job_lease_seconds: int = Field(default=600, ge=5, description="a running job not renewed in this time is retried")
    max_job_attempts: int = Field(default=3, ge=1)
    job_in_child_process: bool = Field(default=True, description=(
        "run each comparison in a short-lived child process: its memory is returned when it ends, and a "
        "crash or OOM kill of it leaves the API (or worker) running; the job is retried"))
    shard_bytes: int = Field(default=4 << 30, ge=0, description=(
        "a comparison whose aligned pairs hold at least this many tensor bytes (both sides) is split into "
        "OPBAND_SHARD_COUNT shards, contiguous ranges of ops that workers judge apart and one merges (0: never)"))
    shard_count: int = Field(default=32, ge=2, le=4096, description=(
        "shards per sharded comparison: several per worker balance the load (the run ends at most one shard after "
        "an even split; a worker goes on from one shard to the next with the bundles open; each further worker "
        "opens them once)"))
    poll_seconds: float = Field(default=0.2, gt=0, le=60, description=(
        "an idle worker looks for a job (a new comparison, a shard another worker split off) this often; each "
        "look is one or two indexed queries, ~1 ms of CPU"))
    max_upload_bytes: int = Field(default=8 << 30, ge=1, description="uploads beyond this get 413")
    max_json_bytes: int = Field(default=1 << 20, ge=1, description="JSON request bodies beyond this get 413, unread")
    max_manifest_bytes: int = Field(default=1 << 30, ge=1, description=(
        "a bundle whose header (tensor table and manifest) and records together are larger gets 413 before "
        "they are parsed (format 2.0 validates records streaming, in flat memory; the header alone is capped "
        "at 100 MB by the format)"))
    max_records: int = Field(default=2_000_000, ge=1, description=(
        "bundles that say they hold more records than this get 413 before they are read (format 2.0 bundles "
        "are validated and ingested streaming, in flat memory: this bounds time and op_records rows)"))
    upload_idle_seconds: float = Field(default=30.0, gt=0, description=(
        "an upload that sends nothing for this long is dropped (408) and its temp file removed"))
    min_free_bytes: int = Field(default=100 << 20, ge=0, description=(
        "below this much free disk under data_dir (and a local blob store) /ready is 503 and uploads are refused"))
    partial_max_age_seconds: int = Field(default=3600, ge=60, description=(
        "upload temp files (.partial) older than this are left by a crash: removed at start and every 10 minutes"))
    metrics_token: str | None = Field(default=None, description=(
        "with auth on, /metrics needs 'Authorization: Bearer <this>' (unset: /metrics answers 403)"))
    admin_token: str | None = Field(default=None, description=(
        "with auth on, /api/v1/admin/* needs 'Authorization: Bearer <this>' (unset: the admin routes answer 403)"))
    auth: bool = Field(default=False, description="require project tokens (on whenever bound beyond loopback)")
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    log_format: str = Field(default="json", description="'json' (one object per line) or 'text'")
    worker_metrics_port: int | None = Field(default=None, ge=0, le=65535, description=(
        "`opband worker` serves Prometheus /metrics on this port (None: off; 0: any free port)"))
    worker_metrics_host: str = Field(default="127.0.0.1", description="address the worker's metrics bind to")

    @property
    def runs_jobs_in_process(self) -> bool:
        """Whether the API process itself runs comparison jobs."""
        return self.queue == "embedded" and self.workers > 0

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> Settings:
        if not self.auth and not _is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without auth: anyone on the network could write results. "
                "Set OPBAND_AUTH=true (and create tokens with `opband token create`) or bind to 127.0.0.1"
            )
        if self.queue not in QUEUES:
            raise ValueError(f"queue must be one of {list(QUEUES)}, not {self.queue!r}")
        if self.log_format not in ("json", "text"):
            raise ValueError(f"log_format must be 'json' or 'text', not {self.log_format!r}")
        return self

    @cached_property
    def effective_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'opband.db').resolve()}"

    @cached_property
    def effective_store_url(self) -> str:
        return self.store_url or str((self.data_dir / "blobs").resolve())
