"""Limits on what one request may cost, checked before the work: body sizes, id ranges, idle uploads.

Every limit is a :class:`~api.settings.Settings` field with a safe default; the answers are 4xx with a
``detail`` that names the setting.
"""

from __future__ import annotations

import json
import re
from typing import Annotated

from fastapi import Path
from starlette.types import ASGIApp, Receive, Scope, Send

#: the largest id the integer primary keys hold on every backend (PostgreSQL ``integer``)
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Path(ge=1, le=MAX_ROW_ID, description="a row id (1 to 2^31-1)")]

#: routes whose body is a bundle (streamed and limited by OPBAND_MAX_UPLOAD_BYTES, not the JSON limit)
_UPLOAD = re.compile(r"^/api/v1/projects/[^/]+/bundles/?$")


def is_upload(scope: Scope) -> bool:
    return scope.get("method") == "POST" and bool(_UPLOAD.match(scope.get("path", "")))


class BodyLimit:
    """Refuse request bodies over ``max_bytes`` (413) before a byte of them is read. A body must
    declare its length: a chunked one (no Content-Length) is a 411. Uploads have their own limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_upload(scope):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is None and b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            await send_json(send, 411, "send the request body with a Content-Length header (chunked bodies are "
                                       "only accepted for bundle uploads)")
            return
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await too_large(send, self.max_bytes)
            return
        await self.app(scope, receive, send)


async def too_large(send: Send, limit: int) -> None:
    await send_json(send, 413, f"request body over {limit} bytes (OPBAND_MAX_JSON_BYTES): send less")


async def send_json(send: Send, status: int, detail: str) -> None:
    raw = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": raw})
