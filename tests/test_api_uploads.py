"""Hostile uploads and query fuzz over live HTTP: every one a 4xx with a message, nothing stored, server healthy."""

from __future__ import annotations

import io
import json
import random
import socket
import struct
import tarfile
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote, urlparse

import httpx
import numpy as np
import pytest
from service_fixtures import LiveServer, SynthOp, start_server, stop_server, upload_bytes, write_bundle

LIMIT = 200_000


@pytest.fixture
def server(tmp_path: Path, database_url: str) -> Iterator[LiveServer]:
    s = start_server(tmp_path / "data", database_url, {"OPBAND_MAX_UPLOAD_BYTES": str(LIMIT)})
    try:
        yield s
    finally:
        stop_server(s)


def archive_zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("../../etc/evil.bundle", b"x" * 100)
    return buf.getvalue()


def archive_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("../escape.bundle")
        info.size = 4
        t.addfile(info, io.BytesIO(b"evil"))
    return buf.getvalue()


def plain_safetensors() -> bytes:
    data = np.arange(4, dtype=np.float32).tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    return struct.pack("<Q", len(header)) + header + data


def huge_header(good: bytes) -> bytes:
    return struct.pack("<Q", 1 << 40) + good[8:]


def raw_request(server: LiveServer, head: str, body: bytes, half_close: bool = True) -> bytes:
    """Send bytes over a socket (then half-close: the client is done) and return the server's answer."""
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


def assert_nothing_stored(server: LiveServer, c: httpx.Client, bundles: int, blobs: list[Path]) -> None:
    assert c.get("/api/v1/projects/h/bundles").json()["count"] == bundles
    assert sorted(server.blob_files()) == sorted(blobs), "no blob and no temp file may be left behind"
    assert list((server.data_dir / "blobs" / ".tmp").iterdir()) == []
    assert c.get("/api/v1/health").status_code == 200 and c.get("/api/v1/ready").status_code == 200


def test_hostile_bodies_are_refused(server: LiveServer, tmp_path: Path) -> None:
    good = write_bundle(tmp_path / "g.bundle", [SynthOp("m.0"), SynthOp("m.1")]).read_bytes()
    cases = {
        "random": random.Random(0).randbytes(5000), "zip-with-dotdot": archive_zip(), "tar-with-dotdot": archive_tar(),
        "pickle": b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.",
        "truncated": good[: len(good) // 2], "header-only": good[:8], "plain-safetensors": plain_safetensors(),
        "huge-declared-header": huge_header(good), "seven-bytes": b"\x00" * 7, "empty": b"",
    }
    with server.client() as c:
        assert upload_bytes(c, "h", good).status_code == 201
        blobs = server.blob_files()
        for name, body in cases.items():
            r = upload_bytes(c, "h", body)
            assert 400 <= r.status_code < 500 and r.json()["detail"], (name, r.status_code, r.text)
        assert "not a valid opband bundle" in upload_bytes(c, "h", plain_safetensors()).json()["detail"]
        assert_nothing_stored(server, c, 1, blobs)


def test_lying_lengths_and_limits(server: LiveServer, tmp_path: Path) -> None:
    good = write_bundle(tmp_path / "g.bundle", [SynthOp("m.0")]).read_bytes()
    path = "/api/v1/projects/h/bundles"
    with server.client() as c:
        assert upload_bytes(c, "h", good).status_code == 201
        blobs = server.blob_files()
        # Content-Length larger than the body: the client gives up half way; nothing may remain
        raw_request(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(good) + 5000}\r\n\r\n", good)
        # smaller than the body: the declared 100 bytes are no bundle, the rest is no HTTP request (uvicorn
        # may answer that one first): 4xx either way
        answer = raw_request(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", good)
        assert answer.startswith((b"HTTP/1.1 422", b"HTTP/1.1 400")), answer[:200]
        # over the limit, declared
        declared = raw_request(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT + 1}\r\n\r\n", b"", False)
        assert declared.startswith(b"HTTP/1.1 413") and b"OPBAND_MAX_UPLOAD_BYTES" in declared, declared[:300]
        # over the limit, chunked (no Content-Length)
        chunk = b"\x00" * 65536
        body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(LIMIT // len(chunk) + 2)) + b"0\r\n\r\n"
        chunked = raw_request(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", body, False)
        assert chunked.startswith(b"HTTP/1.1 413"), chunked[:300]
        r = c.post(path, content=iter([chunk] * (LIMIT // len(chunk) + 2)))
        assert r.status_code == 413 and "limit" in r.json()["detail"]
        bad_length = raw_request(server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", b"")
        assert bad_length.startswith(b"HTTP/1.1 4"), bad_length[:200]
        assert_nothing_stored(server, c, 1, blobs)


def test_concurrent_same_bytes_one_row(server: LiveServer, tmp_path: Path) -> None:
    body = write_bundle(tmp_path / "g.bundle", [SynthOp(f"m.{i}", shape=(256,)) for i in range(40)]).read_bytes()
    assert len(body) < LIMIT

    def send(_: int) -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            return upload_bytes(c, "h", body)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    assert {r.status_code for r in answers} <= {200, 201} and [r.status_code for r in answers].count(201) == 1
    assert len({r.json()["id"] for r in answers}) == 1
    with server.client() as c:
        assert c.get("/api/v1/projects/h/bundles").json()["count"] == 1
    assert len(server.blob_files()) == 1


NASTY = ["", "0", "-1", "1e309", "nan", "x" * 5000, "%00", "\x00", "😀", "' OR 1=1 --", "*", "?", "%", "_", "\\",
         "../..", "true", "[]", "{}", "9" * 40, "a,b,,", "pass,", "desc"]


def test_query_fuzz_no_5xx(server: LiveServer, tmp_path: Path) -> None:
    """Random values for every query parameter and path segment of the read endpoints: never a 5xx."""
    ops = [SynthOp("m.0"), SynthOp("m.1", noise=0.5)]
    with server.client() as c:
        ref = upload_bytes(c, "h", write_bundle(tmp_path / "a.bundle", ops).read_bytes()).json()["id"]
        tgt = upload_bytes(c, "h", write_bundle(tmp_path / "b.bundle", ops, target=True).read_bytes()).json()["id"]
        cid = c.post("/api/v1/projects/h/comparisons", json={"reference": ref, "target": tgt}).json()["id"]
        endpoints = {
            f"/api/v1/comparisons/{cid}/ops": ["op", "module", "shape", "verdict", "metric", "min", "max", "sort",
                                               "order", "limit", "offset", "metrics"],
            "/api/v1/projects/h/regressions": ["status", "op", "shape", "limit", "offset"],
            "/api/v1/projects/h/drift": ["metric", "key", "target", "series", "points"],
            "/api/v1/projects/h/comparisons": ["status", "limit", "offset"],
            "/api/v1/projects/h/bundles": ["limit", "offset"],
            "/api/v1/projects/h/deviations": ["include_expired"],
        }
        rng = random.Random(1)
        for _ in range(150):
            path, names = rng.choice(list(endpoints.items()))
            params = {n: rng.choice(NASTY) for n in rng.sample(names, rng.randint(1, len(names)))}
            r = c.get(path, params=params)
            assert r.status_code < 500, (path, params, r.text)
        for segment in NASTY[1:]:
            for template in ("/api/v1/bundles/{}", "/api/v1/comparisons/{}", "/api/v1/comparisons/{}/ops",
                             "/api/v1/projects/{}/bundles", "/api/v1/bundles/{}/diff/{}", "/api/v1/projects/{}/drift"):
                r = c.get(template.replace("{}", quote(segment, safe="") or "x"))
                assert r.status_code < 500, (template, segment, r.text)
        for body in ({}, {"reference": "x" * 5000, "target": 1}, {"reference": ref, "target": tgt, "mode": "?"}, []):
            assert c.post("/api/v1/projects/h/comparisons", json=body).status_code == 422
        assert c.post("/api/v1/projects/h/comparisons", content=b"{not json").status_code == 422
        assert c.get("/api/v1/health").status_code == 200
