"""Project tokens over live HTTP with OPBAND_AUTH=true: write vs read-only tokens, public projects, isolation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from service_fixtures import LiveServer, SynthOp, create_token, start_server, stop_server, upload_bytes, write_bundle

from api.store.models import Token
from api.settings import Settings


@pytest.fixture
def secured(tmp_path: Path, database_url: str) -> Iterator[LiveServer]:
    server = start_server(tmp_path / "data", database_url, {"OPBAND_AUTH": "true"})
    try:
        yield server
    finally:
        stop_server(server)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_tokens_guard_reads_and_writes(secured: LiveServer, tmp_path: Path) -> None:
    body = write_bundle(tmp_path / "a.bundle", [SynthOp("m.0"), SynthOp("m.1")]).read_bytes()
    write_a, read_a = create_token(secured, "alpha"), create_token(secured, "alpha", read_only=True)
    write_b = create_token(secured, "beta")
    assert write_a.startswith("opb_") and write_a != read_a

    from api.store.db import Database

    db = Database(Settings(database_url=secured.database_url, data_dir=secured.data_dir))
    with db.session() as s:
        hashes = {t.token_hash for t in s.query(Token)}
    db.dispose()
    assert write_a not in hashes and len(hashes) == 3 and all(len(h) == 64 for h in hashes), "stored hashed only"

    with secured.client() as c:
        anon = upload_bytes(c, "alpha", body)
        assert anon.status_code == 401 and "needs a token" in anon.json()["detail"]
        bogus = upload_bytes(c, "alpha", body, token="opb_nope")
        assert bogus.status_code == 401 and "not recognised" in bogus.json()["detail"]
        ro = upload_bytes(c, "alpha", body, token=read_a)
        assert ro.status_code == 403 and "read-only" in ro.json()["detail"]
        other = upload_bytes(c, "alpha", body, token=write_b)
        assert other.status_code == 403 and "does not grant access" in other.json()["detail"]
        missing = upload_bytes(c, "gamma", body, token=write_a)
        # project names cannot be probed: a missing project answers as a forbidden one, word for word
        assert missing.status_code == 403 and missing.json()["detail"] == other.json()["detail"].replace("alpha", "gamma")
        assert upload_bytes(c, "gamma", body).json() == {"detail": anon.json()["detail"].replace("alpha", "gamma")}

        ok = upload_bytes(c, "alpha", body, token=write_a)
        assert ok.status_code == 201, ok.text
        bid = ok.json()["id"]
        for path in ("/api/v1/projects/alpha/bundles", f"/api/v1/bundles/{bid}", f"/api/v1/bundles/{bid}/content",
                     "/api/v1/projects/alpha/regressions", "/api/v1/projects/alpha/drift"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=bearer(write_b)).status_code == (403 if "/projects/" in path else 404), path
            assert c.get(path, headers=bearer(read_a)).status_code == 200, path
        cmp = {"reference": bid, "target": bid}
        assert c.post("/api/v1/projects/alpha/comparisons", json=cmp, headers=bearer(read_a)).status_code == 403
        job = c.post("/api/v1/projects/alpha/comparisons", json=cmp, headers=bearer(write_a))
        assert job.status_code == 202
        # another project's comparison is a 404, as a missing one is
        assert c.get(f"/api/v1/comparisons/{job.json()['id']}", headers=bearer(write_b)).status_code == 404
        assert c.get(f"/api/v1/comparisons/{'0' * 32}", headers=bearer(write_b)).status_code == 404
        assert c.get(f"/api/v1/comparisons/{job.json()['id']}/ops").status_code == 401
        # beta's write token cannot use alpha's bundles in a beta comparison either
        cross = c.post("/api/v1/projects/beta/comparisons", json=cmp, headers=bearer(write_b))
        assert cross.status_code == 422 and "does not exist in project 'beta'" in cross.json()["detail"]
        assert c.get("/api/v1/projects").json()["count"] == 0, "private projects are not listed"

        # a public project: reads need no token, writes still need a write token
        assert c.patch("/api/v1/projects/alpha", json={"public": True}, headers=bearer(read_a)).status_code == 403
        assert c.patch("/api/v1/projects/alpha", json={"public": True}, headers=bearer(write_a)).json()["public"]
        assert c.get("/api/v1/projects/alpha/bundles").json()["count"] == 1
        assert c.get(f"/api/v1/bundles/{bid}/content").content == body
        assert upload_bytes(c, "alpha", body).status_code == 401
        assert [p["name"] for p in c.get("/api/v1/projects").json()["data"]] == ["alpha"]


def test_settings_refuse_open_network_bind() -> None:
    with pytest.raises(ValidationError, match="without auth"):
        Settings(host="0.0.0.0", auth=False)
    with pytest.raises(ValidationError, match="without auth"):
        Settings(host="10.1.2.3")
    assert Settings(host="0.0.0.0", auth=True).auth
    assert not Settings(host="127.0.0.1").auth and not Settings(host="::1").auth
