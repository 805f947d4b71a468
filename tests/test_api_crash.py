"""kill -9 at bad moments: mid-upload and between blob and row. After a restart (and `opband gc`) the
store is clean: no temp file, no blob without its row, no row without its blob."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from service_fixtures import LiveServer, SynthOp, start_server, stop_server, upload_bytes, write_bundle

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def wait_for(predicate, timeout: float = 60, every: float = 0.005) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return False


def temp_files(server: LiveServer) -> list[Path]:
    return list((server.data_dir / "blobs" / ".tmp").glob("*"))


def stored_blobs(server: LiveServer) -> list[Path]:
    return [p for p in server.blob_files() if ".tmp" not in p.parts]


def gc(server: LiveServer, *args: str) -> dict:  # type: ignore[type-arg]
    out = subprocess.run([sys.executable, "-m", "opband.cli", "gc", "--data-dir", str(server.data_dir), *args],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OPBAND_DATABASE_URL": server.database_url})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def assert_clean(server: LiveServer) -> None:
    """Every blob has its row, every row its blob and all its records; no temp file."""
    with server.client() as c:
        rows = c.get("/api/v1/projects/k/bundles").json()["data"] if c.get("/api/v1/projects").json()["count"] else []
    assert temp_files(server) == []
    assert sorted(p.name for p in stored_blobs(server)) == sorted(f"{r['sha256']}.bundle" for r in rows)
    report = gc(server)
    assert report["orphan_blobs"] == [] and report["rows_without_blob"] == [] and report["partials"] == 0


def test_kill_mid_upload_leaves_no_partial_after_restart(tmp_path: Path, database_url: str) -> None:
    """Before: each kill during an upload left blobs/.tmp/*.partial forever."""
    server = start_server(tmp_path / "data", database_url)
    url = urlparse(server.url)
    sock = socket.create_connection((url.hostname, url.port))
    try:
        sock.sendall(f"POST /api/v1/projects/k/bundles HTTP/1.1\r\nHost: x\r\nContent-Length: {50 << 20}\r\n\r\n".encode()
                     + b"\x00" * (4 << 20))
        assert wait_for(lambda: any(p.stat().st_size > 0 for p in temp_files(server)))
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
    finally:
        sock.close()
    assert len(temp_files(server)) == 1, "the kill left the upload's temp file behind"
    server = start_server(tmp_path / "data", database_url)
    try:
        assert wait_for(lambda: temp_files(server) == [], timeout=10), "the restart removes the dead upload's file"
        assert_clean(server)
    finally:
        stop_server(server)


def test_kill_between_blob_and_row_is_cleaned_by_gc(tmp_path: Path, database_url: str) -> None:
    """Before: a kill between storing the blob and committing its row left an orphan blob; nothing found it."""
    body = write_bundle(tmp_path / "big.bundle", [SynthOp(f"m.{i // 50}", shape=(2,)) for i in range(10_000)]).read_bytes()
    small = write_bundle(tmp_path / "small.bundle", [SynthOp("m.0")]).read_bytes()
    server = start_server(tmp_path / "data", database_url)
    with server.client() as c:
        assert upload_bytes(c, "k", small).status_code == 201  # a committed bundle that must survive
    sender = threading.Thread(target=lambda: _upload_quietly(server, body), daemon=True)
    sender.start()
    # the blob lands (a rename) before its 10,000 record rows are inserted and committed: kill right then
    assert wait_for(lambda: len(stored_blobs(server)) == 2, timeout=120, every=0.002)
    server.process.send_signal(signal.SIGKILL)
    server.process.wait(10)
    sender.join(30)
    server = start_server(tmp_path / "data", database_url)
    try:
        with server.client() as c:
            assert c.get("/api/v1/projects/k/bundles").json()["count"] == 1, "the killed upload never committed"
        found = gc(server, "--grace-seconds", "0")
        assert len(found["orphan_blobs"]) == 1 and not found["applied"], found
        assert len(stored_blobs(server)) == 2, "a dry run removes nothing"
        removed = gc(server, "--grace-seconds", "0", "--apply")
        assert removed["orphan_blobs"] == found["orphan_blobs"] and removed["applied"]
        assert_clean(server)
        with server.client() as c:  # the same bytes upload again as new, and the survivor is intact
            assert upload_bytes(c, "k", body).status_code == 201
            assert [b["records"] for b in c.get("/api/v1/projects/k/bundles").json()["data"]] == [10_000, 1]
        assert_clean(server)
    finally:
        stop_server(server)


def _upload_quietly(server: LiveServer, body: bytes) -> None:
    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            upload_bytes(c, "k", body)
    except httpx.HTTPError:
        pass  # the server was killed under it
