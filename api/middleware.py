"""ASGI middleware: one JSON log line and Prometheus samples per request; refuse NUL bytes in URLs."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.observability import LATENCY, REQUESTS

log = logging.getLogger("opband.http")
API_PREFIX = "/api/v1"


class RequestLog:
    """Logs method, path, route template, status and duration_ms; counts requests by route template.

    Unmatched paths are counted as route ``<unmatched>`` so scanners cannot blow up label cardinality.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if b"\x00" in scope.get("raw_path", b"") or b"%00" in scope.get("query_string", b"") \
                or "\x00" in scope.get("path", ""):
            await _reject_nul(send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            seconds = time.perf_counter() - started
            route = _template(scope)
            REQUESTS.labels(scope["method"], route, str(status[0])).inc()
            LATENCY.labels(scope["method"], route).observe(seconds)
            if route != "/metrics":
                log.info("request", extra={"method": scope["method"], "path": scope["path"], "route": route,
                                           "status": status[0], "duration_ms": round(seconds * 1000, 2)})


def _template(scope: Scope) -> str:
    """The matched route's path template with its router prefix (``/api/v1/bundles/{bundle_id}``)."""
    template = getattr(scope.get("route"), "path", None)
    if template is None:
        return "<unmatched>"
    if scope["path"].startswith(API_PREFIX + "/") and not template.startswith(API_PREFIX + "/"):
        template = API_PREFIX + template
    return str(template)


async def _reject_nul(send: Send) -> None:
    body: dict[str, Any] = {"detail": "the URL contains a NUL byte (%00): remove it"}
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})
