"""HTTP client for the opband service: upload, compare, wait, fetch ops. Used by the CLI and gate."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from accuracy.manifest import RunNames


class ClientError(RuntimeError):
    """The server refused or could not be reached; the message says what to do."""


class Client:
    def __init__(self, server: str, token: str | None = None, timeout: float = 60.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if not server.startswith(("http://", "https://")):
            raise ClientError(f"server URL {server!r} needs its scheme, e.g. http://{server.lstrip('/') or '127.0.0.1:8000'}")
        self.server = server.rstrip("/")
        self.http = httpx.Client(base_url=self.server + "/api/v1", headers=headers, timeout=timeout)

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise ClientError(f"cannot reach opband server at {self.server}: {e}. Is `opband serve` running?") from e
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail")
            except ValueError:
                detail = r.text[:500]
            raise ClientError(f"{method} {path} -> HTTP {r.status_code}: {detail}")
        return r.json()

    def upload(self, project: str, bundle: str | os.PathLike[str], names: RunNames | None = None,
               on_bytes: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Stream a bundle file to the server; returns the bundle record (same bytes = same id).
        ``names`` (label, target name, tags) override the manifest's for a first upload;
        ``on_bytes(sent)`` follows the upload."""
        path = Path(bundle)
        try:
            size = path.stat().st_size
        except OSError as e:
            raise ClientError(f"cannot read bundle {path}: {e.strerror}; capture one with `opband capture`") from e

        def body() -> Iterator[bytes]:
            sent = 0
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    yield chunk
                    sent += len(chunk)
                    if on_bytes is not None:
                        on_bytes(sent)

        params: dict[str, Any] = {}
        if names is not None:
            params = {k: v for k, v in (("label", names.label), ("target", names.target)) if v}
            if names.tags:
                params["tag"] = [f"{k}={v}" for k, v in names.tags.items()]
        return self._call("POST", f"/projects/{project}/bundles", content=body(),  # type: ignore[no-any-return]
                          params=params,
                          headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)})

    def create_comparison(self, project: str, reference: str, target: str, mode: str = "propagated") -> dict[str, Any]:
        return self._call("POST", f"/projects/{project}/comparisons",  # type: ignore[no-any-return]
                          json={"reference": reference, "target": target, "mode": mode})

    def comparison(self, comparison_id: str) -> dict[str, Any]:
        return self._call("GET", f"/comparisons/{comparison_id}")  # type: ignore[no-any-return]

    def wait(self, comparison_id: str, timeout: float = 600.0, poll: float = 0.25,
             on_poll: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Poll until the comparison is done or failed; ``on_poll(row)`` sees each state on the way."""
        deadline = time.monotonic() + timeout
        while True:
            c = self.comparison(comparison_id)
            if on_poll is not None:
                on_poll(c)
            if c["status"] in ("done", "failed"):
                return c
            if time.monotonic() > deadline:
                raise ClientError(f"comparison {comparison_id} still {c['status']} after {timeout:.0f}s; "
                                  "are workers running (`opband worker`)?")
            time.sleep(poll)

    def ops(self, comparison_id: str, limit: int = 1000, **filters: Any) -> dict[str, Any]:
        params = {"limit": limit, **{k: v for k, v in filters.items() if v is not None}}
        return self._call("GET", f"/comparisons/{comparison_id}/ops", params=params)  # type: ignore[no-any-return]

    def regressions(self, project: str, status: str = "active", limit: int = 50, offset: int = 0) -> dict[str, Any]:
        """The project's regressions: local out-of-band ops per op key and input shapes."""
        return self._call("GET", f"/projects/{project}/regressions",  # type: ignore[no-any-return]
                          params={"status": status, "limit": limit, "offset": offset})

    def deviations(self, project: str) -> dict[str, Any]:
        """The project's accepted deviations that have not expired."""
        return self._call("GET", f"/projects/{project}/deviations")  # type: ignore[no-any-return]

    def close(self) -> None:
        self.http.close()
