"""The dashboard's JSON endpoints on SQLite and PostgreSQL, against numbers computed here by hand.

Project ``p``: five quiet fp32 runs promoted into baseline ``main`` (so op bands exist), then a run
with two more threads in which op 3 drifts and op 5, downstream, drifts more (inherited: it is
not the first divergence, although it is the worst op).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from scipy import stats
from service_fixtures import LiveServer, SynthOp, wait_done, write_bundle

OPS = [SynthOp(f"model.layers.{i}.mlp", shape=(256,)) for i in range(8)]
KEY = "model.layers.{}.mlp/aten.mm#0".format
QUIET = 2e-7


def _upload(c: httpx.Client, path: Path) -> str:
    r = c.post("/api/v1/projects/p/bundles", content=path.read_bytes())
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def _compare(c: httpx.Client, ref: str, tgt: str) -> str:
    r = c.post("/api/v1/projects/p/comparisons", json={"reference": ref, "target": tgt})
    assert wait_done(c, r.json()["id"])["status"] == "done"
    return str(r.json()["id"])


def test_dashboard_endpoints(live_server: LiveServer, tmp_path: Path) -> None:
    c = live_server.client()
    ref = _upload(c, write_bundle(tmp_path / "ref.bundle", OPS))
    assert c.post("/api/v1/projects/p/baselines", json={"name": "main"}).status_code == 201
    quiet = []
    for i in range(5):
        tgt = _upload(c, write_bundle(tmp_path / f"q{i}.bundle", [SynthOp(o.module, shape=o.shape, noise=QUIET)
                                                                  for o in OPS], target=True, seed=i))
        quiet.append(_compare(c, ref, tgt))
        assert c.post("/api/v1/projects/p/baselines/main/comparisons", json={"comparison": quiet[-1]}).status_code == 200
    noise = {3: 3e-2, 5: 1e-1}
    drift_ops = [SynthOp(o.module, shape=o.shape, noise=noise.get(i, QUIET)) for i, o in enumerate(OPS)]
    drift = _compare(c, ref, _upload(c, write_bundle(tmp_path / "d.bundle", drift_ops, target=True, seed=7,
                                                     environment={"threads": 4})))

    ov = c.get("/api/v1/projects/p/overview").json()
    assert [(t["target"], t["verdict"], t["comparison_id"], t["first_divergence"], t["runs"])
            for t in ov["targets"]] == [("fp32@cpu", "fail", drift, KEY(3), 7)]  # the reference and 6 targets
    assert ov["comparisons"] == 6 and [c["id"] for c in ov["recent"]] == [drift, *quiet[::-1]]
    assert ov["open_regressions"] == 1 and ov["regressions"][0]["key"] == KEY(3)

    runs = c.get(f"/api/v1/comparisons/{drift}/runs").json()
    assert runs["project"] == "p" and runs["categories"] == ["threads"]
    assert [(d["field"], d["a"], d["b"]) for d in runs["changed"]] == [("environment.threads", 2, 4)]
    assert runs["reference"]["target"] == runs["target"]["target"] == "fp32@cpu"

    # folded: op 5's inherited failure sits under op 3, the first divergence; unfolded every op is a row
    folded = c.get(f"/api/v1/comparisons/{drift}/op-groups").json()
    assert folded["count"] == 7 and folded["data"][0]["op"]["key"] == KEY(3)
    assert folded["data"][0]["inherited_count"] == 1 and folded["data"][0]["inherited"][0]["key"] == KEY(5)
    flat = c.get(f"/api/v1/comparisons/{drift}/op-groups", params={"fold": "false"}).json()
    assert flat["count"] == 8 and all(not g["inherited"] for g in flat["data"])
    assert [g["op"]["key"] for g in c.get(f"/api/v1/comparisons/{drift}/op-groups",
                                           params={"fold": "false", "verdict": "fail"}).json()["data"]] == [KEY(3), KEY(5)]
    assert [g["op"]["key"] for g in c.get(f"/api/v1/comparisons/{drift}/op-groups",
                                           params={"fold": "false", "search": "layers.6"}).json()["data"]] == [KEY(6)]

    # the drift chart's default view: the first divergence is shown even when one series is asked
    # for and op 5 was worse (before, "worst of all" showed op 5 alone)
    assert [s["key"] for s in c.get("/api/v1/projects/p/drift", params={"series": 1}).json()] == [KEY(3)]
    assert [s["key"] for s in c.get("/api/v1/projects/p/drift", params={"series": 2}).json()] == [KEY(3), KEY(5)]

    # op history: the band at each point is the tolerance bound of the runs accepted before it
    hist = c.get("/api/v1/projects/p/op-history", params={"key": KEY(3)}).json()
    (series,) = hist["series"]
    assert hist["targets"] == ["fp32@cpu"] and hist["op"] == "aten.mm"
    pts = series["points"]
    assert [p["comparison_id"] for p in pts] == quiet + [drift]
    assert [p["band"] is None for p in pts] == [True] * 5 + [False]  # five accepted runs are the minimum
    accepted = np.log([p["value"] for p in pts[:5]])
    k = stats.nct.ppf(0.95, df=4, nc=stats.norm.ppf(0.99) * math.sqrt(5)) / math.sqrt(5)
    assert pts[5]["band"] == pytest.approx(math.exp(accepted.mean() + k * max(accepted.std(ddof=1), 0.02)), rel=1e-9)
    assert pts[5]["out"] and pts[5]["value"] > pts[5]["band"] and not any(p["out"] for p in pts[:5])
    assert all(p["budget"] == 2.0**-15 for p in pts)  # the float32 default norm_l2 budget
    assert [a["comparison_id"] for a in hist["accepted_in"]] == quiet[::-1]
    assert series["regression"]["status"] == "active"

    # op detail: histogram of all 256 elements, and both sides' statistics
    d = c.get(f"/api/v1/comparisons/{drift}/op", params={"key": KEY(3)}).json()
    assert sum(b["count"] for b in d["histogram"]) == 256 and set(d["quantiles"]) == {"p50", "p90", "p99", "p99.9"}
    values = np.random.default_rng(1000 + 3).standard_normal(256).astype(np.float32).astype(np.float64)
    assert d["reference_stats"]["numel"] == 256
    assert d["reference_stats"]["mean"] == pytest.approx(values.mean(), rel=1e-6)
    assert d["reference_stats"]["absmax"] == pytest.approx(np.abs(values).max(), rel=1e-7)
    rng = np.random.default_rng(7)  # the target's noise, drawn as write_bundle draws it: ops 0-3 in order
    noise3 = [rng.standard_normal(256) for _ in range(4)][3]
    target = (values.astype(np.float32) + (3e-2 * noise3).astype(np.float32)).astype(np.float64)
    assert d["target_stats"]["mean"] == pytest.approx(target.mean(), rel=1e-6)
    assert d["target_stats"]["max"] == pytest.approx(target.max(), rel=1e-7)

    # heatmap: out of band (severity > 1) exactly where the noise was injected
    hm = c.get("/api/v1/projects/p/heatmap").json()
    assert [r["comparison_id"] for r in hm["runs"]] == quiet + [drift]
    assert [o["key"] for o in hm["ops"]] == [KEY(i) for i in range(8)]
    assert {(i, j) for i, row in enumerate(hm["z"]) for j, v in enumerate(row) if v > 1} == {(3, 5), (5, 5)}
    assert hm["verdicts"][5][5] == "fail"
    # ops that move together side by side: 3 and 5 drifted in the same run
    similar = [o["key"] for o in c.get("/api/v1/projects/p/heatmap", params={"order": "similar"}).json()["ops"]]
    assert sorted(similar) == [KEY(i) for i in range(8)] and abs(similar.index(KEY(3)) - similar.index(KEY(5))) == 1

    # the audit: who acknowledged, accepted (with expiry), and whose withdrawal re-opened it
    rid = ov["regressions"][0]["id"]
    assert c.patch(f"/api/v1/regressions/{rid}", json={"status": "acknowledged", "author": "bo"}).status_code == 200
    dev = c.post("/api/v1/projects/p/deviations", json={"key_pattern": KEY(3), "reason": "known", "author": "cy",
                                                       "expires_at": "2099-01-01T00:00:00Z"}).json()
    assert dev["accepted_regressions"] == 1
    bot = subprocess.run([sys.executable, "-m", "opband.cli", "token", "create", "--project", "p", "--name", "ci-bot",
                          "--data-dir", str(live_server.data_dir)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "OPBAND_DATABASE_URL": live_server.database_url}).stdout.strip()
    assert c.delete(f"/api/v1/projects/p/deviations/{dev['id']}",
                    headers={"Authorization": f"Bearer {bot}"}).status_code == 204  # re-opened by a named token
    assert c.patch(f"/api/v1/regressions/{rid}", json={"status": "resolved", "note": "fixed upstream"}).status_code == 200
    events = c.get("/api/v1/projects/p/regression-events", params={"regression": rid}).json()
    assert events["count"] == 5
    assert [(e["status"], e["actor"], e["note"]) for e in events["data"][:4]] == [
        ("resolved", "anonymous", "fixed upstream"), ("active", "ci-bot", f"accepted deviation {dev['id']} withdrawn"),
        ("accepted", "cy", "known"), ("acknowledged", "bo", None)]
    opened = events["data"][4]  # opband's own: the drift run opened it
    assert (opened["status"], opened["actor"]) == ("active", f"opband (comparison {drift})")
    assert opened["note"].startswith("opened: ")
    assert {(e["key"], e["target"]) for e in events["data"]} == {(KEY(3), "fp32@cpu")}
    assert events["data"][2]["expires_at"].startswith("2099-01-01") and events["data"][2]["deviation_id"] == dev["id"]
    every = c.get("/api/v1/projects/p/regression-events").json()["data"]  # the others: each opened by opband
    others = [e for e in every if e["regression_id"] != rid]
    assert len(others) == len(ov["regressions"]) - 1
    assert all(e["actor"] == f"opband (comparison {drift})" and e["note"].startswith("opened: ") for e in others)

    # bad input: a clear 4xx, never a traceback
    assert c.get("/api/v1/projects/p/op-history", params={"key": "nope"}).status_code == 404
    assert "metric must be one of" in c.get("/api/v1/projects/p/heatmap", params={"metric": "x"}).json()["detail"]
    assert c.get(f"/api/v1/comparisons/{drift}/op", params={"key": "nope"}).status_code == 404


def test_category_of_names_what_changed() -> None:
    from accuracy.envdiff import category_of

    assert {f: category_of(f) for f in (
        "environment.torch", "environment.cuda", "environment.cudnn", "environment.threads", "environment.tf32_matmul",
        "environment.deterministic", "run.seed", "run.variant", "environment.device_name", "run.device",
        "environment.git_commit", "environment.hostname", "tags.cann", "tags.op-library", "tags.branch")} == {
        "environment.torch": "torch", "environment.cuda": "driver", "environment.cudnn": "op library",
        "environment.threads": "threads", "environment.tf32_matmul": "flags", "environment.deterministic": "flags",
        "run.seed": "inputs", "run.variant": "dtype", "environment.device_name": "driver", "run.device": "device",
        "environment.git_commit": "code", "environment.hostname": "other", "tags.cann": "driver",
        "tags.op-library": "op library", "tags.branch": "code"}
