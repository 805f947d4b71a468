"""Runs and targets have names: --label, --target and --tag from capture or upload to the database,
series and regressions kept per target name, the API's filters, and the 0004_i11 migration with data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from accuracy.bundle import Bundle
from accuracy.errors import BundleError
from accuracy.manifest import Manifest, run_names
from api.store.db import downgrade, make_engine, upgrade
from service_fixtures import LiveServer, SynthOp, wait_done, write_bundle

OPS = [SynthOp(f"m.l{i}") for i in range(4)]
BROKEN = [SynthOp(f"m.l{i}", noise=0.5 if i == 2 else 0.0) for i in range(4)]


def opband(*args: str, timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "opband.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_names_are_validated_with_a_sentence() -> None:
    names = run_names("nightly", "ascend-910b/bf16", ["branch=main", "cann=8.0.RC2", "empty="])
    assert (names.label, names.target, names.tags) == ("nightly", "ascend-910b/bf16",
                                                       {"branch": "main", "cann": "8.0.RC2", "empty": ""})
    for bad, says in ((dict(target="my target"), "e.g. ascend-910b/bf16"), (dict(tags=["branch"]), "KEY=VALUE"),
                      (dict(tags={"a b": "x"}), "tag key 'a b'"), (dict(label="x" * 201), "at most 200")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(")):
            run_names(**bad)  # type: ignore[arg-type]
    assert Manifest(run={"variant": "bf16", "device": "cpu"}).target == "bf16@cpu"
    assert Manifest(run={"variant": "bf16", "target": "npu/bf16"}).target == "npu/bf16"
    with pytest.raises(BundleError, match="manifest run target '../../etc'"):
        Manifest(run={"target": "../../etc"}).names
    assert Manifest(run={"label": 42}).names.label == "42"  # older writers' labels stay readable


def test_capture_records_names_in_the_manifest_and_refuses_bad_ones(tmp_path: Path) -> None:
    out = tmp_path / "r.bundle"
    r = opband("capture", "hooks.demo_model:build", "-o", str(out), "--device", "cpu", "--level", "module",
               "--label", "nightly-1", "--target", "cpu-x86/fp32", "--tag", "branch=main", "--tag", "commit=abc123")
    assert r.returncode == 0, r.stderr
    run = Bundle.open(out).manifest.run
    assert (run["label"], run["target"], run["tags"]) == ("nightly-1", "cpu-x86/fp32",
                                                          {"branch": "main", "commit": "abc123"})
    r = opband("capture", "hooks.demo_model:build", "-o", str(tmp_path / "x.bundle"), "--tag", "nokey")
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr and not (tmp_path / "x.bundle").exists()


def _upload(server: LiveServer, path: Path, *flags: str) -> dict:  # type: ignore[type-arg]
    r = opband("upload", str(path), "--server", server.url, "--project", "p", *flags, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_series_and_regressions_are_kept_per_target_name(live_server: LiveServer, tmp_path: Path) -> None:
    """Two unrelated fp32@cpu targets: each has its own series; a pass of one never resolves the
    other's regression, a later pass of the same target does."""
    ref = _upload(live_server, write_bundle(tmp_path / "ref.bundle", OPS), "--label", "reference")
    assert ref["target"] == "fp32@cpu" and ref["tags"] == {}  # no name given: variant@device, as before
    broken = write_bundle(tmp_path / "a-broken.bundle", BROKEN, target=True)
    a1 = _upload(live_server, broken, "--target", "npu-a/fp32", "--label", "a-1", "--tag", "cann=8.0",
                 "--tag", "branch=main")
    assert (a1["target"], a1["label"], a1["tags"]) == ("npu-a/fp32", "a-1", {"cann": "8.0", "branch": "main"})
    b1 = _upload(live_server, write_bundle(tmp_path / "b-ok.bundle", OPS, target=True, environment={"host": "b"}), "--target", "npu-b/fp32")
    a2 = _upload(live_server, write_bundle(tmp_path / "a-ok.bundle", OPS, target=True, environment={"host": "a"}), "--target", "npu-a/fp32",
                 "--label", "a-2")
    with live_server.client() as c:
        def compare(target: dict) -> dict:  # type: ignore[type-arg]
            cid = c.post("/api/v1/projects/p/comparisons", json={"reference": ref["id"], "target": target["id"]}).json()["id"]
            return wait_done(c, cid)

        first = compare(a1)
        assert first["verdict"] == "fail"
        assert first["target_run"]["target"] == "npu-a/fp32" and first["target_run"]["label"] == "a-1"
        assert first["reference_run"]["label"] == "reference" and first["target_run"]["tags"]["cann"] == "8.0"
        regs = c.get("/api/v1/projects/p/regressions").json()
        assert [(r["key"], r["target"]) for r in regs["data"]] == [("m.l2/aten.mm#0", "npu-a/fp32")]
        assert compare(b1)["verdict"] == "pass"  # another target passing: npu-a's regression stays open
        assert c.get("/api/v1/projects/p/regressions").json()["count"] == 1
        drift = c.get("/api/v1/projects/p/drift", params={"key": "m.l2/*"}).json()
        assert sorted(d["target"] for d in drift) == ["npu-a/fp32", "npu-b/fp32"]
        assert compare(a2)["verdict"] == "pass"  # a later pass of the same target resolves it
        resolved = c.get("/api/v1/projects/p/regressions", params={"status": "resolved"}).json()["data"]
        assert [(r["target"], r["last_comparison_id"]) for r in resolved] == [("npu-a/fp32", c.get(
            "/api/v1/projects/p/comparisons", params={"label": "a-2"}).json()["data"][0]["id"])]
        # filters: by target name, label and tags
        listed = c.get("/api/v1/projects/p/bundles", params={"target": "npu-a/fp32"}).json()
        assert {b["label"] for b in listed["data"]} == {"a-1", "a-2"}
        tagged = c.get("/api/v1/projects/p/bundles", params=[("tag", "cann=8.0"), ("tag", "branch=main")]).json()
        assert [b["id"] for b in tagged["data"]] == [a1["id"]]
        assert c.get("/api/v1/projects/p/bundles", params={"tag": "cann=9"}).json()["count"] == 0
        assert c.get("/api/v1/projects/p/bundles", params={"tag": "cann"}).status_code == 422
        assert c.get("/api/v1/projects/p/comparisons", params={"target": "npu-a/fp32"}).json()["count"] == 2
        assert c.get("/api/v1/projects/p/regressions", params={"target": "npu-b/fp32", "status": "active,resolved"}
                     ).json()["count"] == 0
        targets = {t["target"]: t for t in c.get("/api/v1/projects/p/targets").json()}
        assert set(targets) == {"fp32@cpu", "npu-a/fp32", "npu-b/fp32"}
        assert (targets["npu-a/fp32"]["bundles"], targets["npu-a/fp32"]["latest_verdict"],
                targets["npu-a/fp32"]["latest_label"]) == (2, "pass", "a-2")
        assert targets["fp32@cpu"]["latest_comparison_id"] is None
        bad = c.post("/api/v1/projects/p/bundles", params={"target": "has space"}, content=b"x")
        assert bad.status_code == 422 and "ascend-910b/bf16" in bad.json()["detail"]
    _names_from_the_manifest_and_upload_overrides(live_server, tmp_path)  # on the same server (one start less)


def _names_from_the_manifest_and_upload_overrides(live_server: LiveServer, tmp_path: Path) -> None:
    """capture -> upload: the manifest's names land in the database; upload flags override them."""
    named = write_bundle(tmp_path / "named.bundle", OPS, target=True, variant="bf16", run={
        "label": "cap", "target": "npu/bf16", "tags": {"branch": "dev", "driver": "24.1"}})
    row = _upload(live_server, named)
    assert (row["label"], row["target"], row["tags"]) == ("cap", "npu/bf16", {"branch": "dev", "driver": "24.1"})
    other = tmp_path / "other.bundle"
    other.write_bytes(named.read_bytes() + b"")  # same bytes: same row, whatever the flags say
    r = opband("upload", str(other), "--server", live_server.url, "--project", "p", "--target", "elsewhere/bf16")
    again = json.loads(r.stdout)
    assert r.returncode == 0 and again["id"] == row["id"] and again["target"] == "npu/bf16"
    assert "uploaded before" in r.stderr and "names given now are not applied" in r.stderr
    path2 = write_bundle(tmp_path / "t2.bundle", OPS, target=True, variant="bf16", environment={"host": "t2"})
    row2 = _upload(live_server, path2, "--label", "up", "--target", "npu/bf16", "--tag", "driver=25")
    assert (row2["label"], row2["target"], row2["tags"]) == ("up", "npu/bf16", {"driver": "25"})
    bad = write_bundle(tmp_path / "bad.bundle", OPS, target=True, run={"target": "my npu"})
    with live_server.client() as c:
        r = c.post("/api/v1/projects/p/bundles", content=bad.read_bytes())
        assert r.status_code == 422 and "manifest run target 'my npu'" in r.json()["detail"]
        assert c.post("/api/v1/projects/p/bundles", params={"target": "npu/fp32"},  # overridden at upload: fine
                      content=bad.read_bytes()).status_code == 201


def test_0004_gives_existing_bundles_their_target_names(database_url: str) -> None:
    """Bundles stored before 0004 get ``variant@device`` (the name their series already use) or the
    manifest's run.target, and run.tags; downgrade drops the columns and upgrade fills them again."""
    upgrade(database_url, "0003")
    engine = make_engine(database_url)
    now = "2026-01-01 00:00:00"
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO projects (id, name, public, created_at) VALUES (1, 'p', false, :t)"), {"t": now})
        for bid, variant, run in (("old", "bf16", {}), ("named", "fp32", {"target": "npu/fp32", "tags": {"cann": 8}})):
            conn.execute(text("INSERT INTO bundles (id, project_id, sha256, size, storage_key, variant, device, "
                              "records, run, environment, created_at) VALUES (:i, 1, :i, 1, 'k', :v, 'cpu', 0, :r, "
                              "'{}', :t)"), {"i": bid, "v": variant, "r": json.dumps(run), "t": now})
        conn.execute(text("INSERT INTO comparisons (id, project_id, reference_id, target_id, mode, status, counts, "
                          "unmatched, attempts, created_at) VALUES ('c', 1, 'old', 'named', 'propagated', 'done', "
                          "'{}', 0, 0, :t)"), {"t": now})
    engine.dispose()

    def rows() -> dict[str, tuple[str, dict]]:  # type: ignore[type-arg]
        eng = make_engine(database_url)
        with eng.connect() as conn:
            got = {r[0]: (r[1], json.loads(r[2]) if isinstance(r[2], str) else r[2])
                   for r in conn.execute(text("SELECT id, target, tags FROM bundles"))}
        eng.dispose()
        return got

    for _ in range(2):
        upgrade(database_url)
        assert rows() == {"old": ("bf16@cpu", {}), "named": ("npu/fp32", {"cann": "8"})}
        downgrade(database_url, "0003")
        eng = make_engine(database_url)
        assert not {"target", "tags"} & {c["name"] for c in inspect(eng).get_columns("bundles")}
        with eng.connect() as conn:  # the data stays: the comparison still references both bundles
            assert conn.execute(text("SELECT count(*) FROM comparisons")).scalar() == 1
        eng.dispose()


def test_a_late_older_comparison_never_resolves_a_newer_failure(database_url: str, tmp_path: Path) -> None:
    """Jobs finish out of order: the failure queued last stays open when the pass queued before it
    finishes after it. Only a pass queued later resolves it."""
    from api.jobs.comparisons import run_job
    from api.settings import Settings
    from api.store.blobs import make_store
    from api.store.db import Database
    from service_fixtures import start_server, stop_server, upload_bytes

    server = start_server(tmp_path / "data", database_url, {"OPBAND_WORKERS": "0"})
    settings = Settings(database_url=database_url, data_dir=server.data_dir, workers=0)
    db, store = Database(settings), make_store(settings.effective_store_url)
    try:
        with server.client() as c:
            def upload(name: str, ops: list[SynthOp], **kw: object) -> str:
                body = write_bundle(tmp_path / name, ops, **kw).read_bytes()  # type: ignore[arg-type]
                return upload_bytes(c, "late", body).json()["id"]  # type: ignore[no-any-return]

            ref = upload("ref.bundle", OPS)
            ok, bad = upload("ok.bundle", OPS, target=True, environment={"host": "ok"}), upload("bad.bundle", BROKEN, target=True)

            def queue(target: str) -> str:
                return c.post("/api/v1/projects/late/comparisons", json={"reference": ref, "target": target}).json()["id"]

            def run(job: str) -> None:  # claim this very job, as a worker would, then run it
                with db.engine.begin() as conn:
                    conn.execute(text("UPDATE comparisons SET status = 'running', worker = 't', attempts = 1 "
                                      "WHERE id = :i"), {"i": job})
                assert run_job(db, store, settings, job, "t") == "done"

            older_pass, newer_fail = queue(ok), queue(bad)
            run(newer_fail)
            run(older_pass)  # finishes last, but was queued before the failure
            regs = c.get("/api/v1/projects/late/regressions", params={"status": "active,resolved"}).json()["data"]
            assert [(r["status"], r["last_comparison_id"]) for r in regs] == [("active", newer_fail)]
            later_pass = queue(ok)
            run(later_pass)
            regs = c.get("/api/v1/projects/late/regressions", params={"status": "active,resolved"}).json()["data"]
            assert [(r["status"], r["last_comparison_id"]) for r in regs] == [("resolved", later_pass)]
    finally:
        db.engine.dispose()
        stop_server(server)
