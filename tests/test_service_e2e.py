"""End to end through a live uvicorn, on SQLite and on PostgreSQL: upload, compare, query, gate."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from service_fixtures import LiveServer, wait_done

FAULTY_SPEC = '''
import torch
from hooks.demo_model import build as _build

def build():
    model, inputs = _build()
    with torch.no_grad():
        # one corrupted weight element in layer 1's MLP down projection
        model.model.layers[1].mlp.down_proj.weight[3, 7] += 40.0
    return model, inputs
'''


def upload(client: httpx.Client, project: str, path: Path) -> httpx.Response:
    return client.post(f"/api/v1/projects/{project}/bundles", content=path.read_bytes(),
                       headers={"Content-Type": "application/octet-stream"})


def compare(client: httpx.Client, project: str, ref: str, tgt: str) -> dict:  # type: ignore[type-arg]
    r = client.post(f"/api/v1/projects/{project}/comparisons", json={"reference": ref, "target": tgt})
    assert r.status_code == 202, r.text
    assert r.json()["status"] in ("pending", "running", "done")
    return wait_done(client, r.json()["id"])


def test_upload_compare_query(live_server: LiveServer, demo_bundles: dict[str, Path]) -> None:
    with live_server.client() as c:
        ref = upload(c, "p1", demo_bundles["ref"])
        assert ref.status_code == 201, ref.text
        again = upload(c, "p1", demo_bundles["ref"])
        assert again.status_code == 200 and again.json()["id"] == ref.json()["id"], "same bytes must give the same id"
        ref2 = upload(c, "p1", demo_bundles["ref2"]).json()
        bf16 = upload(c, "p1", demo_bundles["bf16"]).json()
        assert bf16["variant"] == "bf16" and bf16["records"] > 100

        listing = c.get("/api/v1/projects/p1/bundles").json()
        assert listing["count"] == 3 and len(listing["data"]) == 3

        same = compare(c, "p1", ref.json()["id"], ref2["id"])
        assert same["status"] == "done" and same["verdict"] == "pass", same
        assert same["counts"]["pass"] > 100 and same["counts"]["fail"] == 0
        ops = c.get(f"/api/v1/comparisons/{same['id']}/ops", params={"limit": 1000}).json()
        assert ops["count"] == same["counts"]["pass"]
        assert all(o["verdict"] == "pass" and o["max_abs"] == 0 for o in ops["data"])

        low = compare(c, "p1", ref.json()["id"], bf16["id"])
        assert low["status"] == "done"
        worst = c.get(f"/api/v1/comparisons/{low['id']}/ops", params={"limit": 20, "verdict": "pass,warn,fail"}).json()
        values = [o["severity"] for o in worst["data"]]
        assert values == sorted(values, reverse=True), "ops must come worst first"
        assert worst["data"][0]["norm_l2"] > 1e-3, "bf16 must show non-zero errors"
        # filters: module glob and op name
        mm = c.get(f"/api/v1/comparisons/{low['id']}/ops", params={"op": "aten.mm", "module": "model.layers.0.*"}).json()
        assert mm["count"] == 7 and all(o["module"].startswith("model.layers.0.") for o in mm["data"])
        bad = c.get(f"/api/v1/comparisons/{low['id']}/ops", params={"verdict": "great"})
        assert bad.status_code == 422 and "unknown verdict" in bad.json()["detail"]

        drift = c.get("/api/v1/projects/p1/drift", params={"metric": "norm_l2"}).json()
        assert drift and all(s["points"] for s in drift)
        assert c.get("/api/v1/projects/p1/regressions").json()["count"] == 0

        content = c.get(f"/api/v1/bundles/{bf16['id']}/content")
        assert content.status_code == 200 and content.content == demo_bundles["bf16"].read_bytes()


def test_hostile_upload_stores_nothing(live_server: LiveServer, demo_bundles: dict[str, Path]) -> None:
    with live_server.client() as c:
        assert upload(c, "p2", demo_bundles["ref"]).status_code == 201
        before_blobs = live_server.blob_files()
        good = demo_bundles["ref"].read_bytes()
        cases = {
            "random": os.urandom(4096),
            "truncated": good[: len(good) // 2],
            "pickle": b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.",
            "json-not-bundle": b'{"hello": "world"}',
        }
        for name, body in cases.items():
            r = c.post("/api/v1/projects/p2/bundles", content=body)
            assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
            assert r.json()["detail"], name
        empty = c.post("/api/v1/projects/p2/bundles", content=b"")
        assert empty.status_code == 422 and "empty body" in empty.json()["detail"]
        assert c.get("/api/v1/projects/p2/bundles").json()["count"] == 1
        assert live_server.blob_files() == before_blobs, "a failed upload must leave no blob"
        assert c.get("/api/v1/health").json() == {"status": "ok"}
        assert c.get("/api/v1/ready").status_code == 200


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_gate_exit_codes(live_server: LiveServer, demo_bundles: dict[str, Path], tmp_path: Path) -> None:
    from hooks import run_capture

    spec = tmp_path / "faulty.py"
    spec.write_text(FAULTY_SPEC)
    faulty = run_capture(f"{spec}:build", tmp_path / "faulty.bundle", device="cpu")

    def gate(target: Path, server: str = live_server.url) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "opband.cli", "gate", "--server", server, "--project", "g",
             "--reference", str(demo_bundles["ref"]), "--target", str(target),
             "--junit", str(tmp_path / "junit.xml"), "--markdown", str(tmp_path / "gate.md")],
            capture_output=True, text=True, timeout=300,
        )

    ok = gate(demo_bundles["ref2"])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASSED" in ok.stdout
    bad = gate(faulty)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED | first divergence: model.layers.1.mlp.down_proj/" in bad.stdout
    assert "<failure" in (tmp_path / "junit.xml").read_text()
    assert "opband gate: FAIL" in (tmp_path / "gate.md").read_text()
    with httpx.Client(base_url=live_server.url) as c:
        regs = c.get("/api/v1/projects/g/regressions").json()
    assert regs["count"] == 1 and regs["data"][0]["key"].startswith("model.layers.1.mlp.down_proj/")
    # an accepted deviation covers the failure: the gate passes and says so, with the expiry
    with httpx.Client(base_url=live_server.url) as c:
        c.post("/api/v1/projects/g/deviations", json={"key_pattern": regs["data"][0]["key"], "reason": "known kernel",
                                                      "author": "ci", "expires_at": "2099-01-01T00:00:00Z"})
    accepted = gate(faulty)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert f"ACCEPTED | {regs['data'][0]['key']} | deviation #" in accepted.stdout
    assert "known kernel; expires 2099-01-01" in accepted.stdout
    down = gate(faulty, server="http://127.0.0.1:9")
    assert down.returncode == 2 and "cannot reach" in down.stderr
