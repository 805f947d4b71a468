"""Operations over a project's life: tokens listed and revoked, export/import SQLite -> PostgreSQL,
retention and delete endpoints, admin gc and metrics behind tokens, db upgrade on an unreachable database."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from service_fixtures import (
    LiveServer, SynthOp, create_token, start_server, stop_server, upload_bytes, wait_done, write_bundle,
)


def cli(*args: str, database_url: str, data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opband.cli", *args, "--data-dir", str(data_dir)], capture_output=True,
                          text=True, timeout=180, env={**os.environ, "OPBAND_DATABASE_URL": database_url})


def compare(c: httpx.Client, project: str, ref: str, tgt: str) -> dict:  # type: ignore[type-arg]
    job = c.post(f"/api/v1/projects/{project}/comparisons", json={"reference": ref, "target": tgt})
    assert job.status_code == 202, job.text
    return wait_done(c, job.json()["id"])


def snapshot(c: httpx.Client, project: str) -> dict:  # type: ignore[type-arg]
    bundles = c.get(f"/api/v1/projects/{project}/bundles").json()["data"]
    comparisons = c.get(f"/api/v1/projects/{project}/comparisons").json()["data"]
    return {
        "bundles": sorted((b["id"], b["sha256"], b["records"]) for b in bundles),
        "blobs": {b["id"]: c.get(f"/api/v1/bundles/{b['id']}/content").content for b in bundles},
        "comparisons": sorted((x["id"], x["verdict"], x["counts"]["fail"]) for x in comparisons),
        "ops": {x["id"]: [(o["key"], o["verdict"]) for o in c.get(f"/api/v1/comparisons/{x['id']}/ops",
                                                                   params={"limit": 1000}).json()["data"]]
                for x in comparisons},
        "regressions": sorted((r["key"], r["status"], r["target"]) for r in c.get(
            f"/api/v1/projects/{project}/regressions", params={"status": "active,acknowledged,accepted,resolved"}).json()["data"]),
        "baselines": [(b["name"], b["comparisons"]) for b in c.get(f"/api/v1/projects/{project}/baselines").json()["data"]],
        "deviations": [(d["key_pattern"], d["reason"]) for d in c.get(f"/api/v1/projects/{project}/deviations").json()["data"]],
    }


def test_export_from_sqlite_import_into_postgresql(tmp_path: Path, pg_url: str) -> None:
    """Before: no backup, export or restore story at all."""
    ops = [SynthOp("m.0"), SynthOp("m.1", noise=0.5), SynthOp("m.2")]
    source = start_server(tmp_path / "a", f"sqlite:///{tmp_path / 'a.db'}")
    try:
        with source.client() as c:
            ref = upload_bytes(c, "p", write_bundle(tmp_path / "r.bundle", ops).read_bytes()).json()["id"]
            tgt = upload_bytes(c, "p", write_bundle(tmp_path / "t.bundle", ops, target=True).read_bytes()).json()["id"]
            done = compare(c, "p", ref, tgt)
            assert done["verdict"] == "fail"
            c.post("/api/v1/projects/p/baselines", json={"name": "main"}).raise_for_status()
            c.post("/api/v1/projects/p/baselines/main/comparisons", json={"comparison": done["id"], "force": True}).raise_for_status()
            c.post("/api/v1/projects/p/deviations", json={"key_pattern": "m.1/*", "reason": "known", "author": "me"}).raise_for_status()
            before = snapshot(c, "p")
        assert before["regressions"] and before["baselines"][0][1] == [done["id"]]
        out = cli("project", "export", "p", "-o", str(tmp_path / "p.tar"), database_url=source.database_url,
                  data_dir=source.data_dir)
        assert out.returncode == 0, out.stderr
    finally:
        stop_server(source)
    from api.store.db import upgrade

    upgrade(pg_url)
    out = cli("project", "import", str(tmp_path / "p.tar"), database_url=pg_url, data_dir=tmp_path / "b")
    assert out.returncode == 0, out.stderr
    again = cli("project", "import", str(tmp_path / "p.tar"), database_url=pg_url, data_dir=tmp_path / "b")
    assert again.returncode == 2 and "exists already" in again.stderr
    target = start_server(tmp_path / "b", pg_url)
    try:
        with target.client() as c:
            assert snapshot(c, "p") == before
            # the imported history works: a new comparison against it runs and names the same regression
            later = compare(c, "p", ref, tgt)
            assert later["verdict"] == "fail"
    finally:
        stop_server(target)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_retention_and_delete(live_server: LiveServer, tmp_path: Path) -> None:
    """Before: no retention policy and no delete endpoints."""
    ops = [SynthOp("m.0"), SynthOp("m.1")]
    with live_server.client() as c:
        ref = upload_bytes(c, "p", write_bundle(tmp_path / "r.bundle", ops).read_bytes()).json()["id"]
        targets = [upload_bytes(c, "p", write_bundle(tmp_path / f"t{i}.bundle", [SynthOp("m.0", noise=1e-7),
                                                                                   SynthOp("m.1")], target=True,
                                                       seed=i).read_bytes()).json()["id"] for i in range(3)]
        runs = [compare(c, "p", ref, t)["id"] for t in targets]
        c.post("/api/v1/projects/p/baselines", json={"name": "main"}).raise_for_status()
        c.post("/api/v1/projects/p/baselines/main/comparisons", json={"comparison": runs[0]}).raise_for_status()

        policy = {"keep_runs": 1, "keep_days": 0}
        dry = c.post("/api/v1/projects/p/retention", json=policy).json()
        # the newest is kept (keep_runs=1), the oldest because a baseline holds it: only the middle one goes
        assert dry == {"comparisons": [runs[1]], "bundles": [targets[1]], "kept_comparisons": 2, "applied": False}
        assert len(live_server.blob_files()) == 4
        done = c.post("/api/v1/projects/p/retention", json={**policy, "apply": True}).json()
        assert done["applied"] and done["comparisons"] == [runs[1]]
        assert c.get(f"/api/v1/comparisons/{runs[1]}").status_code == 404
        assert c.get(f"/api/v1/bundles/{targets[1]}").status_code == 404 and len(live_server.blob_files()) == 3

        used = c.delete(f"/api/v1/bundles/{ref}")
        assert used.status_code == 409 and "force=true" in used.json()["detail"]
        held = c.delete(f"/api/v1/comparisons/{runs[0]}")
        assert held.status_code == 409 and "baseline" in held.json()["detail"]
        assert c.delete(f"/api/v1/comparisons/{runs[2]}").status_code == 204
        assert c.delete(f"/api/v1/bundles/{ref}", params={"force": True}).status_code == 204
        assert c.get(f"/api/v1/comparisons/{runs[0]}").status_code == 404, "force took its comparisons with it"
        assert c.get("/api/v1/projects/p/bundles").json()["count"] == 2 and len(live_server.blob_files()) == 2
        assert c.delete("/api/v1/projects/p").status_code == 204
        assert c.get("/api/v1/projects").json()["count"] == 0 and live_server.blob_files() == []
        assert c.delete("/api/v1/projects/p").status_code == 404


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_tokens_listed_and_revoked_admin_and_metrics_behind_tokens(tmp_path: Path, database_url: str) -> None:
    """Before: no token list/revoke; /metrics open with auth on; no admin gc endpoint."""
    server = start_server(tmp_path / "data", database_url, {"OPBAND_AUTH": "true", "OPBAND_METRICS_TOKEN": "m-secret",
                                                           "OPBAND_ADMIN_TOKEN": "a-secret"})
    try:
        token = create_token(server, "p")
        listed = cli("token", "list", database_url=database_url, data_dir=server.data_dir)
        assert listed.returncode == 0 and "p" in listed.stdout and "write" in listed.stdout
        assert token not in listed.stdout, "secrets are never shown again"
        with server.client() as c:
            headers = {"Authorization": f"Bearer {token}"}
            assert c.get("/api/v1/projects/p/bundles", headers=headers).status_code == 200
            assert c.get("/metrics").status_code == 403 and c.get("/metrics", headers=headers).status_code == 403
            assert "opband_http_requests_total" in c.get("/metrics", headers={"Authorization": "Bearer m-secret"}).text
            assert c.post("/api/v1/admin/gc", headers=headers).status_code == 403
            gc = c.post("/api/v1/admin/gc", headers={"Authorization": "Bearer a-secret"})
            assert gc.status_code == 200 and gc.json()["applied"] is False
            token_id = listed.stdout.split("│")[1].strip() if "│" in listed.stdout else "1"
            revoked = cli("token", "revoke", token_id, database_url=database_url, data_dir=server.data_dir)
            assert revoked.returncode == 0, revoked.stderr
            r = c.get("/api/v1/projects/p/bundles", headers=headers)
            assert r.status_code == 401 and "revoked" in r.json()["detail"]
        missing = cli("token", "revoke", "999", database_url=database_url, data_dir=server.data_dir)
        assert missing.returncode == 2 and "opband token list" in missing.stderr
    finally:
        stop_server(server)


def test_db_upgrade_on_an_unreachable_database_says_what_to_do(tmp_path: Path) -> None:
    """Before: a traceback."""
    out = cli("db", "upgrade", database_url="postgresql+psycopg://postgres@127.0.0.1:1/nowhere", data_dir=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "cannot migrate the database" in out.stderr and "OPBAND_DATABASE_URL" in out.stderr
