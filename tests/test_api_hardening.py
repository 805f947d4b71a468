"""The reproducers of issue 13 over live HTTP on SQLite and PostgreSQL: user input never a 5xx, auth
before lookup, outages and full disks answered 503 with a detail, limits enforced before the work."""

from __future__ import annotations

import resource
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from service_fixtures import (
    LiveServer, SynthOp, create_token, start_server, stop_server, upload_bytes, wait_done, write_bundle,
)

BIG_IDS = (2**31, 2**63, 2**64, 10**30)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def failing_comparison(c: httpx.Client, tmp_path: Path, project: str, token: str | None = None) -> dict:  # type: ignore[type-arg]
    """A finished comparison with one op out of band (so one regression)."""
    ops = [SynthOp("m.0"), SynthOp("m.1", noise=0.5)]
    headers = bearer(token) if token else {}
    ref = upload_bytes(c, project, write_bundle(tmp_path / "r.bundle", ops).read_bytes(), token).json()["id"]
    tgt = upload_bytes(c, project, write_bundle(tmp_path / "t.bundle", ops, target=True).read_bytes(), token).json()["id"]
    job = c.post(f"/api/v1/projects/{project}/comparisons", json={"reference": ref, "target": tgt}, headers=headers)
    return wait_done(c, job.json()["id"])


def test_ids_past_the_column_range_and_nul_characters(live_server: LiveServer, tmp_path: Path) -> None:
    """Before: PATCH /regressions/2147483648 was a 500 on PostgreSQL (2^63 on SQLite); NUL in a JSON
    string or a bundle's names was a 500 on PostgreSQL."""
    with live_server.client() as c:
        done = failing_comparison(c, tmp_path, "p")
        assert done["verdict"] == "fail"
        reg = c.get("/api/v1/projects/p/regressions").json()["data"][0]
        for big in BIG_IDS:
            for r, name in ((c.patch(f"/api/v1/regressions/{big}", json={"status": "acknowledged"}), "regression_id"),
                            (c.delete(f"/api/v1/projects/p/deviations/{big}"), "deviation_id")):
                assert r.status_code == 422 and name in r.json()["detail"], (big, r.text)
        assert c.patch("/api/v1/regressions/0", json={"status": "resolved"}).status_code == 422
        assert c.patch("/api/v1/regressions/2147483647", json={"status": "resolved"}).status_code == 404
        assert c.delete("/api/v1/projects/p/deviations/2147483647").status_code == 404

        nul = "a\x00b"
        bodies = {"/api/v1/projects/p/deviations": {"key_pattern": "m.*", "reason": nul, "author": "me"},
                  "/api/v1/projects/p/baselines": {"name": nul},
                  "/api/v1/projects/p/comparisons": {"reference": nul, "target": nul}}
        for path, body in bodies.items():
            r = c.post(path, json=body)
            assert r.status_code == 422 and r.json()["detail"], (path, r.text)
        r = c.post("/api/v1/projects/p/deviations", json={"key_pattern": "m.*", "reason": "ok", "author": nul})
        assert r.status_code == 422 and "NUL" in r.json()["detail"]
        assert c.patch(f"/api/v1/regressions/{reg['id']}", json={"status": nul}).status_code == 422

        blobs = live_server.blob_files()
        bad_key = write_bundle(tmp_path / "k.bundle", [SynthOp("m\x00x")]).read_bytes()
        bad_env = write_bundle(tmp_path / "e.bundle", [SynthOp("m.0")], environment={"git_branch": nul}).read_bytes()
        for body, what in ((bad_key, "NUL"), (bad_env, "NUL")):
            r = upload_bytes(c, "p", body)
            assert r.status_code == 422 and what in r.json()["detail"], r.text
            assert upload_bytes(c, "never-made", body).status_code == 422
        assert live_server.blob_files() == blobs
        assert [p["name"] for p in c.get("/api/v1/projects").json()["data"]] == ["p"], \
            "an invalid upload creates no project"
        assert c.get("/api/v1/ready").status_code == 200


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_authorization_before_lookup(tmp_path: Path, database_url: str) -> None:
    """Before: PATCH /regressions/{id} looked the regression up first and worked without a token;
    a missing project answered 404 where an existing one answered 401 (names could be probed)."""
    server = start_server(tmp_path / "data", database_url, {"OPBAND_AUTH": "true"})
    try:
        write, other = create_token(server, "alpha"), create_token(server, "beta")
        read = create_token(server, "alpha", read_only=True)
        with httpx.Client(base_url=server.url, timeout=60, headers=bearer(write)) as owner:
            failing_comparison(owner, tmp_path, "alpha", write)
            reg = owner.get("/api/v1/projects/alpha/regressions").json()["data"][0]
        with server.client() as c:
            path = f"/api/v1/regressions/{reg['id']}"
            body = {"status": "acknowledged"}
            for rid in (reg["id"], 999_999):
                anon = c.patch(f"/api/v1/regressions/{rid}", json=body)
                assert anon.status_code == 401 and "needs a token" in anon.json()["detail"]
            theirs = c.patch(path, json=body, headers=bearer(other))
            missing = c.patch("/api/v1/regressions/999999", json=body, headers=bearer(other))
            assert theirs.status_code == missing.status_code == 404
            assert theirs.json()["detail"].replace(str(reg["id"]), "N") == missing.json()["detail"].replace("999999", "N")
            assert c.patch(path, json=body, headers=bearer(read)).status_code == 403
            assert c.patch(path, json=body, headers=bearer(write)).json()["status"] == "acknowledged"
            # project names: missing and private answer alike, with or without a token
            for headers in ({}, bearer(other)):
                a = c.get("/api/v1/projects/alpha/bundles", headers=headers)
                z = c.get("/api/v1/projects/zeta/bundles", headers=headers)
                assert a.status_code == z.status_code and a.status_code in (401, 403)
                assert a.json()["detail"].replace("alpha", "X") == z.json()["detail"].replace("zeta", "X")
            assert c.delete("/api/v1/projects/alpha/deviations/1").status_code == 401
            # /metrics is no longer open when auth is on
            assert c.get("/metrics").status_code == 403
    finally:
        stop_server(server)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_database_down_is_a_503_with_detail(live_server: LiveServer, tmp_path: Path) -> None:
    """Before: a plain-text 500."""
    import psycopg
    from service_fixtures import PG_ADMIN_URL

    body = write_bundle(tmp_path / "a.bundle", [SynthOp("m.0")]).read_bytes()
    with live_server.client() as c:
        assert upload_bytes(c, "p", body).status_code == 201
        name = live_server.database_url.rsplit("/", 1)[1]
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        for r in (c.get("/api/v1/projects/p/bundles"), upload_bytes(c, "p", body), c.get("/api/v1/projects"),
                  c.post("/api/v1/projects/p/baselines", json={"name": "main"})):
            assert r.status_code == 503, r.text
            assert r.headers["content-type"] == "application/json" and "database is unavailable" in r.json()["detail"]
    stop_server(live_server)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_full_disk_is_a_503_and_not_ready(tmp_path: Path, database_url: str) -> None:
    """Before: a plain-text 500 on a full disk, and /ready 200 with 0 bytes free."""
    body = write_bundle(tmp_path / "a.bundle", [SynthOp(f"m.{i}", shape=(4096,)) for i in range(64)]).read_bytes()
    assert len(body) > 1 << 20
    # the disk "fills up" at 1 MiB per file: writes past it fail with EFBIG, as a full disk fails with ENOSPC
    server = start_server(tmp_path / "data", database_url,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20)))
    try:
        with server.client() as c:
            r = upload_bytes(c, "p", body)
            assert r.status_code == 503 and "disk is full" in r.json()["detail"], r.text
            assert list((server.data_dir / "blobs" / ".tmp").iterdir()) == []
            assert c.get("/api/v1/health").status_code == 200
    finally:
        stop_server(server)
    # below OPBAND_MIN_FREE_BYTES (here: more than any disk has) /ready fails and uploads are refused unread
    server = start_server(tmp_path / "data2", database_url, {"OPBAND_MIN_FREE_BYTES": str(1 << 60)})
    try:
        with server.client() as c:
            ready = c.get("/api/v1/ready")
            assert ready.status_code == 503 and "disk" in ready.json()["detail"], ready.text
            r = upload_bytes(c, "p", body)
            assert r.status_code == 503 and "almost full" in r.json()["detail"]
    finally:
        stop_server(server)


def raw(server: LiveServer, data: bytes, wait: float = 10) -> bytes:
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=wait) as sock:
        sock.sendall(data)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_limits_before_the_work(tmp_path: Path, database_url: str) -> None:
    """Before: JSON bodies had no limit and were read before auth; a huge field was echoed in the 422;
    a stalled upload stayed open for good; records and manifests had no limit."""
    env = {"OPBAND_AUTH": "true", "OPBAND_MAX_JSON_BYTES": "10000", "OPBAND_UPLOAD_IDLE_SECONDS": "1",
           "OPBAND_MAX_RECORDS": "5", "OPBAND_MAX_MANIFEST_BYTES": "6000"}
    server = start_server(tmp_path / "data", database_url, env)
    try:
        token = create_token(server, "p")
        with server.client() as c:
            huge = {"reference": "x" * 200_000, "target": "y"}
            r = c.post("/api/v1/projects/p/comparisons", json=huge)  # no token: refused on its length, unread
            assert r.status_code == 413 and "OPBAND_MAX_JSON_BYTES" in r.json()["detail"]
            r = c.post("/api/v1/projects/p/comparisons", json={"reference": "x" * 9000, "target": "y"},
                       headers=bearer(token))
            assert r.status_code == 422 and len(r.content) < 2000 and "xxxxxxxxxx" not in r.text, r.text[:300]
            r = c.post("/api/v1/projects/p/comparisons", json={"x" * 9000: 1}, headers=bearer(token))
            assert r.status_code == 422 and len(r.content) < 3000
            chunked = raw(server, b"POST /api/v1/projects/p/baselines HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                                  b"\r\nContent-Type: application/json\r\n\r\n5\r\n{\"a\":\r\n")
            assert chunked.startswith(b"HTTP/1.1 411"), chunked[:200]

            many = write_bundle(tmp_path / "many.bundle", [SynthOp(f"m.{i}") for i in range(6)]).read_bytes()
            r = upload_bytes(c, "p", many, token)
            assert r.status_code == 413 and "OPBAND_MAX_RECORDS" in r.json()["detail"]
            wide = write_bundle(tmp_path / "wide.bundle", [SynthOp("m" * 700 + f".{i}") for i in range(5)]).read_bytes()
            r = upload_bytes(c, "p", wide, token)
            assert r.status_code == 413 and "OPBAND_MAX_MANIFEST_BYTES" in r.json()["detail"]

            # a stalled upload: 1 KB of a declared 5 MB, then silence: dropped after the idle time
            started = time.monotonic()
            answer = raw(server, (f"POST /api/v1/projects/p/bundles HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}"
                                  f"\r\nContent-Length: {5 << 20}\r\n\r\n").encode() + b"\x00" * 1024, wait=30)
            assert answer.startswith(b"HTTP/1.1 408") and b"OPBAND_UPLOAD_IDLE_SECONDS" in answer, answer[:300]
            assert time.monotonic() - started < 25
            assert list((server.data_dir / "blobs" / ".tmp").iterdir()) == []
            assert c.get("/api/v1/projects/p/bundles", headers=bearer(token)).json()["count"] == 0
    finally:
        stop_server(server)
