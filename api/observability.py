"""Structured JSON logs and Prometheus metrics, shared by the API and the workers."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from api.settings import Settings

REQUESTS = Counter("opband_http_requests_total", "HTTP requests by route template, method and status",
                   ["method", "route", "status"])
LATENCY = Histogram("opband_http_request_duration_seconds", "HTTP request latency by route template",
                    ["method", "route"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120))
UPLOAD_BYTES = Counter("opband_upload_bytes_total", "bytes of bundle uploads received (accepted or not)")
UPLOADS = Counter("opband_uploads_total", "bundle uploads by outcome", ["outcome"])
JOB_SECONDS = Histogram("opband_comparison_duration_seconds", "wall time of comparison jobs run in this process",
                        ["status"], buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))
JOBS_FINISHED = Counter("opband_jobs_finished_total", "comparison jobs finished by this process", ["status"])

#: attributes every LogRecord has; anything else passed in ``extra=`` goes into the JSON line
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(settings: Settings) -> None:
    """Send opband's loggers to stderr in the configured format (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if settings.log_format == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger("opband")
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    root.propagate = False


class JobsByStatus(Collector):
    """``opband_jobs{status}``: comparisons per status, read from the database at scrape time.

    Read from the shared table, so it counts jobs of every worker process, not just this one.
    """

    def __init__(self, db: Any) -> None:
        self.db = db

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from api.store.models import Comparison

        family = GaugeMetricFamily("opband_jobs", "comparison jobs by status (all workers)", labels=["status"])
        try:
            with self.db.session() as s:
                rows = dict(s.execute(select(Comparison.status, func.count()).group_by(Comparison.status)).all())
        except Exception:  # noqa: BLE001 - a scrape must not fail because the database hiccuped
            rows = {}
        for status in ("pending", "running", "done", "failed"):
            family.add_metric([status], rows.get(status, 0))
        yield family


def serve_worker_metrics(db: Any, host: str, port: int) -> int:
    """Serve this process's Prometheus metrics (and ``opband_jobs`` from ``db``) over HTTP on a
    daemon thread; returns the bound port (``port=0`` picks a free one)."""
    from prometheus_client import REGISTRY, start_http_server

    REGISTRY.register(JobsByStatus(db))
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_address[1])
