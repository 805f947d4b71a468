"""Queries and review over live HTTP on SQLite and PostgreSQL: filters, pages, drift bands, baselines,
accepted deviations, acknowledgements and environment diffs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
from service_fixtures import LiveServer, SynthOp, upload_bytes, wait_done, write_bundle

OPS = [
    SynthOp(f"model.layers.{layer}.{part}", op, shape, noise=0.5 if (layer, part, op) == (2, "mlp", "aten.mm") else 0.0)
    for layer in range(4) for part in ("attn", "mlp") for op, shape in (("aten.mm", (64,)), ("aten.add", (32,)))
]


def run_pair(c: httpx.Client, tmp: Path, project: str, env: dict | None = None) -> tuple[str, str, dict]:  # type: ignore[type-arg]
    ref = upload_bytes(c, project, write_bundle(tmp / "ref.bundle", OPS).read_bytes()).json()["id"]
    tgt = upload_bytes(c, project, write_bundle(tmp / f"tgt-{project}.bundle", OPS, target=True, variant="bf16",
                                                environment=env).read_bytes()).json()["id"]
    r = c.post(f"/api/v1/projects/{project}/comparisons", json={"reference": ref, "target": tgt})
    return ref, tgt, wait_done(c, r.json()["id"])


def ops(c: httpx.Client, cid: str, **params: object) -> dict:  # type: ignore[type-arg]
    r = c.get(f"/api/v1/comparisons/{cid}/ops", params=params)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_op_result_filters_and_pages(live_server: LiveServer, tmp_path: Path) -> None:
    with live_server.client() as c:
        _, _, cmp = run_pair(c, tmp_path, "q")
        cid = cmp["id"]
        assert cmp["verdict"] == "fail" and cmp["counts"]["fail"] == 1 and cmp["counts"]["pass"] == 15
        assert ops(c, cid)["count"] == 16
        assert {o["op"] for o in ops(c, cid, op="aten.add")["data"]} == {"aten.add"}
        assert ops(c, cid, op="aten.add")["count"] == 8
        assert ops(c, cid, module="model.layers.1.*")["count"] == 4
        assert ops(c, cid, module="*.mlp")["count"] == 8
        assert ops(c, cid, module="model.layers.?.attn", op="aten.mm")["count"] == 4
        assert ops(c, cid, shape="32")["count"] == 8 and ops(c, cid, shape="64")["count"] == 8
        fail = ops(c, cid, verdict="fail", metrics=True)
        assert fail["count"] == 1 and fail["data"][0]["key"] == "model.layers.2.mlp/aten.mm#0"
        assert fail["data"][0]["metrics"] and fail["data"][0]["budget"]["norm_l2"] > 0
        assert ops(c, cid, verdict="pass,fail")["count"] == 16
        high = ops(c, cid, metric="norm_l2", min=1e-3)
        assert high["count"] == 1 and high["data"][0]["verdict"] == "fail"
        assert ops(c, cid, metric="norm_l2", max=1e-3)["count"] == 15
        assert ops(c, cid, metric="norm_l2", min=0, max=1e9)["count"] == 16
        by_key = [o["key"] for o in ops(c, cid, sort="key", order="asc", limit=100)["data"]]
        assert by_key == sorted(by_key)
        by_index = [o["index"] for o in ops(c, cid, sort="index", order="desc", limit=100)["data"]]
        assert by_index == sorted(by_index, reverse=True)
        pages = [ops(c, cid, sort="index", order="asc", limit=5, offset=o) for o in (0, 5, 10, 15)]
        assert [len(p["data"]) for p in pages] == [5, 5, 5, 1] and all(p["count"] == 16 for p in pages)
        assert [o["index"] for p in pages for o in p["data"]] == list(range(16))
        assert ops(c, cid, offset=100)["data"] == []
        for params, message in (({"sort": "nope"}, "sort must be"), ({"order": "up"}, "order must"),
                                ({"min": 1}, "metric range needs"), ({"verdict": "great"}, "unknown verdict"),
                                ({"limit": 0}, "limit"), ({"limit": 5000}, "limit"), ({"offset": -1}, "offset")):
            r = c.get(f"/api/v1/comparisons/{cid}/ops", params=params)
            assert r.status_code == 422 and message in r.json()["detail"], (params, r.text)
        assert c.get("/api/v1/comparisons/nope/ops").status_code == 404


def test_regressions_drift_and_review(live_server: LiveServer, tmp_path: Path) -> None:
    with live_server.client() as c:
        ref, tgt, cmp = run_pair(c, tmp_path, "r", env={"threads": 8, "cuda": "12.4"})
        regs = c.get("/api/v1/projects/r/regressions").json()
        assert regs["count"] == 1
        reg = regs["data"][0]
        assert (reg["key"], reg["op"], reg["shape_signature"], reg["status"]) == \
            ("model.layers.2.mlp/aten.mm#0", "aten.mm", "64", "active")
        assert c.get("/api/v1/projects/r/regressions", params={"op": "aten.add"}).json()["count"] == 0
        assert c.get("/api/v1/projects/r/regressions", params={"op": "aten.mm", "shape": "64"}).json()["count"] == 1
        assert c.get("/api/v1/projects/r/regressions", params={"shape": "32"}).json()["count"] == 0

        drift = c.get("/api/v1/projects/r/drift", params={"metric": "norm_l2", "series": 3}).json()
        assert len(drift) == 3 and drift[0]["key"] == "model.layers.2.mlp/aten.mm#0", "worst series first"
        assert drift[0]["target"] == "bf16@cpu" and drift[0]["points"][0]["budget"] > 0, "points carry the band"
        one = c.get("/api/v1/projects/r/drift", params={"key": "model.layers.0.attn/aten.mm#0", "metric": "cosine"}).json()
        assert len(one) == 1 and one[0]["points"][0]["value"] > 0.99 and one[0]["points"][0]["budget"] is not None
        assert c.get("/api/v1/projects/r/drift", params={"target": "int8@npu"}).json() == []
        assert c.get("/api/v1/projects/r/drift", params={"metric": "bogus"}).status_code == 422

        # acknowledge, then accept through a deviation
        ack = c.patch(f"/api/v1/regressions/{reg['id']}", json={"status": "acknowledged"})
        assert ack.status_code == 200 and ack.json()["status"] == "acknowledged"
        assert c.patch(f"/api/v1/regressions/{reg['id']}", json={"status": "meh"}).status_code == 422
        assert c.patch("/api/v1/regressions/999999", json={"status": "active"}).status_code == 404
        past = (datetime.now(UTC) - timedelta(days=1)).isoformat()
        stale = c.post("/api/v1/projects/r/deviations",
                       json={"key_pattern": "*", "reason": "x", "author": "me", "expires_at": past})
        assert stale.status_code == 422 and "in the past" in stale.json()["detail"]
        soon = (datetime.now(UTC) + timedelta(days=30)).isoformat()
        dev = c.post("/api/v1/projects/r/deviations", json={
            "key_pattern": "model.layers.2.mlp/aten.mm#*", "shape_signature": "64",
            "reason": "bf16 accumulation in the MLP is known and harmless", "author": "ana", "expires_at": soon})
        assert dev.status_code == 201 and dev.json()["accepted_regressions"] == 1, dev.text
        listed = c.get("/api/v1/projects/r/deviations").json()
        assert listed["count"] == 1 and listed["data"][0]["author"] == "ana" and listed["data"][0]["expires_at"]
        assert c.get("/api/v1/projects/r/regressions").json()["count"] == 0
        assert c.get("/api/v1/projects/r/regressions", params={"status": "accepted"}).json()["data"][0]["id"] == reg["id"]

        # baselines: create, promote (fail needs force), list, get, delete
        assert c.post("/api/v1/projects/r/baselines", json={"name": "main"}).status_code == 201
        assert c.post("/api/v1/projects/r/baselines", json={"name": "main"}).status_code == 409
        assert c.post("/api/v1/projects/r/baselines", json={"name": "../x"}).status_code == 422
        refused = c.post("/api/v1/projects/r/baselines/main/comparisons", json={"comparison": cmp["id"]})
        assert refused.status_code == 409 and "force" in refused.json()["detail"]
        promoted = c.post("/api/v1/projects/r/baselines/main/comparisons", json={"comparison": cmp["id"], "force": True})
        assert promoted.status_code == 200 and promoted.json()["comparisons"] == [cmp["id"]]
        again = c.post("/api/v1/projects/r/baselines/main/comparisons", json={"comparison": cmp["id"], "force": True})
        assert again.json()["comparisons"] == [cmp["id"]], "promoting twice keeps one member"
        assert c.post("/api/v1/projects/r/baselines/main/comparisons", json={"comparison": "nope"}).status_code == 404
        assert c.post("/api/v1/projects/r/baselines/dev/comparisons", json={"comparison": cmp["id"]}).status_code == 404
        assert c.get("/api/v1/projects/r/baselines").json()["data"][0]["name"] == "main"
        assert c.get("/api/v1/projects/r/baselines/main").json()["comparisons"] == [cmp["id"]]
        assert c.delete("/api/v1/projects/r/baselines/main").status_code == 204
        assert c.get("/api/v1/projects/r/baselines/main").status_code == 404
        assert c.get("/api/v1/projects/r/baselines").json()["count"] == 0

        # branch names with '/' (release/2.4), also %2F-encoded; '..' and a '/comparisons' tail refused
        assert c.post("/api/v1/projects/r/baselines", json={"name": "release/2.4"}).status_code == 201
        got = c.post("/api/v1/projects/r/baselines/release/2.4/comparisons", json={"comparison": cmp["id"], "force": True})
        assert got.status_code == 200 and got.json() == {**got.json(), "name": "release/2.4", "comparisons": [cmp["id"]]}
        assert c.get("/api/v1/projects/r/baselines/release%2F2.4").json()["comparisons"] == [cmp["id"]]
        assert c.get("/api/v1/projects/r/baselines/release").status_code == 404
        for bad in ("release/../main", "x/comparisons", "a//b", "a/", "/a"):
            r = c.post("/api/v1/projects/r/baselines", json={"name": bad})
            assert r.status_code == 422 and r.json()["detail"], (bad, r.text)
        assert c.delete("/api/v1/projects/r/baselines/release/2.4").status_code == 204
        assert c.get("/api/v1/projects/r/baselines").json()["count"] == 0

        # environment diff
        diff = c.get(f"/api/v1/bundles/{ref}/diff/{tgt}").json()
        changed = {d["field"]: (d["a"], d["b"]) for d in diff["changed"]}
        assert changed == {"environment.threads": (2, 8), "environment.cuda": (None, "12.4"),
                           "run.variant": ("fp32", "bf16")}, changed
        assert diff["same"] >= 4
        assert c.get(f"/api/v1/bundles/{ref}/diff/{ref}").json()["changed"] == []
        assert c.get(f"/api/v1/bundles/{ref}/diff/nope").status_code == 404


def test_an_expired_or_withdrawn_deviation_opens_its_regression_again(live_server: LiveServer, tmp_path: Path) -> None:
    """Accepting through a deviation lasts as long as the deviation: once it expires, the next
    failure opens the regression again; deleting it opens it at once. A status set by a person
    stays as set."""
    import time

    with live_server.client() as c:
        def reg() -> dict:  # type: ignore[type-arg]
            data = c.get("/api/v1/projects/x/regressions", params={"status": "active,acknowledged,accepted"}).json()
            assert data["count"] == 1, data
            return data["data"][0]  # type: ignore[no-any-return]

        run_pair(c, tmp_path, "x")
        assert (reg()["status"], reg()["accepted_by"]) == ("active", None)
        expires = datetime.now(UTC) + timedelta(seconds=3)
        dev = c.post("/api/v1/projects/x/deviations", json={
            "key_pattern": "model.layers.2.mlp/*", "reason": "known, until the fix lands", "author": "ana",
            "expires_at": expires.isoformat()}).json()
        assert (reg()["status"], reg()["accepted_by"]) == ("accepted", dev["id"])
        run_pair(c, tmp_path, "x")  # fails again while the deviation lives: still accepted
        assert (reg()["status"], reg()["accepted_by"]) == ("accepted", dev["id"])
        time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.2)
        run_pair(c, tmp_path, "x")  # fails after it expired: open again
        assert (reg()["status"], reg()["accepted_by"]) == ("active", None)
        audit = c.get("/api/v1/projects/x/regression-events", params={"regression": reg()["id"]}).json()["data"]
        assert [(e["status"], e["actor"].startswith("opband (comparison ")) for e in audit] == [
            ("active", True), ("accepted", False), ("active", True)]  # newest first: opband re-opened it, as it opened it
        assert "expired" in audit[0]["note"] and audit[1]["actor"] == "ana"

        forever = c.post("/api/v1/projects/x/deviations", json={
            "key_pattern": "model.layers.2.*", "shape_signature": "64", "reason": "r", "author": "bo"}).json()
        assert forever["accepted_regressions"] == 1 and reg()["accepted_by"] == forever["id"]
        assert c.delete(f"/api/v1/projects/x/deviations/{forever['id']}").status_code == 204
        assert (reg()["status"], reg()["accepted_by"]) == ("active", None)  # withdrawn: open at once
        assert c.delete(f"/api/v1/projects/x/deviations/{forever['id']}").status_code == 404

        again = c.post("/api/v1/projects/x/deviations", json={"key_pattern": "*", "reason": "r", "author": "cy"}).json()
        assert reg()["accepted_by"] == again["id"]
        reopened = c.patch(f"/api/v1/regressions/{reg()['id']}", json={"status": "active"}).json()
        assert (reopened["status"], reopened["accepted_by"]) == ("active", None)
        run_pair(c, tmp_path, "x")  # fails again, the deviation still matches: a person's "active" stays
        assert (reg()["status"], reg()["accepted_by"]) == ("active", None)
        assert c.delete(f"/api/v1/projects/x/deviations/{again['id']}").status_code == 204

        by_hand = c.patch(f"/api/v1/regressions/{reg()['id']}", json={"status": "accepted"}).json()
        assert (by_hand["status"], by_hand["accepted_by"]) == ("accepted", None)
        run_pair(c, tmp_path, "x")
        assert (reg()["status"], reg()["accepted_by"]) == ("accepted", None)  # a person's decision is kept


def test_non_finite_failures_sort_first_and_regressions_name_their_target(live_server: LiveServer, tmp_path: Path) -> None:
    """A NaN output fails with an infinite severity: worst first puts it before finite failures
    (it was stored as NULL and sorted last, so the gate's table could leave out the only NaN)."""
    ops = [SynthOp(f"m.l{i}", noise=0.3 if i in (1, 4) else 0.0, nan=i == 7) for i in range(10)]
    with live_server.client() as c:
        ref = upload_bytes(c, "n", write_bundle(tmp_path / "ref.bundle", ops).read_bytes()).json()["id"]
        tgt = upload_bytes(c, "n", write_bundle(tmp_path / "tgt.bundle", ops, target=True, variant="bf16")
                           .read_bytes()).json()["id"]
        cmp = wait_done(c, c.post("/api/v1/projects/n/comparisons", json={"reference": ref, "target": tgt}).json()["id"])
        assert cmp["counts"]["fail"] == 3, cmp
        worst = ops_of(c, cmp["id"])  # the offline order: the local first divergence, then the inherited by severity
        assert [(o["key"], o["inherited"], o["severity"] == "inf") for o in worst[:3]] == [
            ("m.l1/aten.mm#0", False, False), ("m.l7/aten.mm#0", True, True), ("m.l4/aten.mm#0", True, False)]
        assert [o["verdict"] for o in worst[:3]] == ["fail"] * 3 and worst[3]["verdict"] == "pass"
        assert all(isinstance(o["severity"], float) for o in worst if o["key"] != "m.l7/aten.mm#0")
        assert [o["key"] for o in worst if o["nonfinite"]] == ["m.l7/aten.mm#0"]
        from opband.gate import gate_table

        row = next(line for line in gate_table(cmp, worst).splitlines() if "m.l7/aten.mm#0" in line)
        assert "NaN/Inf" in row  # not the finite part's norm_l2 of 0, which would read as a perfect op
        by_severity = ops_of(c, cmp["id"], sort="severity")
        assert by_severity[0]["key"] == "m.l7/aten.mm#0"
        reverse = ops_of(c, cmp["id"], order="asc")
        assert [o["key"] for o in reverse] == [o["key"] for o in worst][::-1]
        drift = c.get("/api/v1/projects/n/drift", params={"series": 2}).json()
        # the open regression / first divergence first, then the worst series: the NaN one
        assert [d["key"] for d in drift] == ["m.l1/aten.mm#0", "m.l7/aten.mm#0"]
        sev = c.get("/api/v1/projects/n/drift", params={"key": "m.l7/*", "metric": "severity"}).json()
        assert sev[0]["points"][0]["value"] is None and sev[0]["points"][0]["verdict"] == "fail"  # a gap, not 1e300
        assert [o["key"] for o in ops_of(c, cmp["id"], metric="severity", min="inf")] == ["m.l7/aten.mm#0"]

        regs = c.get("/api/v1/projects/n/regressions").json()
        assert regs["count"] == 1 and {(r["target"], r["dtype"]) for r in regs["data"]} == {("bf16@cpu", "float32")}
        assert c.get("/api/v1/projects/n/regressions", params={"target": "bf16@cpu"}).json()["count"] == 1
        assert c.get("/api/v1/projects/n/regressions", params={"target": "int8@npu"}).json()["count"] == 0
        assert c.get("/api/v1/projects/n/regressions", params={"dtype": "bfloat16"}).json()["count"] == 0
        for path in ("/api/v1/projects/n/regressions", "/api/v1/projects/n/comparisons"):
            r = c.get(path, params={"status": "bogus"})
            assert r.status_code == 422 and "bogus" in r.json()["detail"] and "use any of" in r.json()["detail"], r.text
        assert c.get("/api/v1/projects/n/comparisons", params={"status": "done,failed"}).json()["count"] == 1


def ops_of(c: httpx.Client, cid: str, **params: object) -> list[dict]:  # type: ignore[type-arg]
    r = c.get(f"/api/v1/comparisons/{cid}/ops", params={"limit": 100, **params})
    assert r.status_code == 200, r.text
    return r.json()["data"]  # type: ignore[no-any-return]


def test_golden_mode_needs_a_golden_reference(live_server: LiveServer, tmp_path: Path) -> None:
    with live_server.client() as c:
        ref, tgt, _ = run_pair(c, tmp_path, "g")
        r = c.post("/api/v1/projects/g/comparisons", json={"reference": ref, "target": tgt, "mode": "golden"})
        assert r.status_code == 422 and "--replay REF --golden" in r.json()["detail"], r.text
        assert c.get("/api/v1/projects/g/comparisons").json()["count"] == 1, "nothing queued"


def test_timestamps_are_utc_in_every_reply(live_server: LiveServer, tmp_path: Path) -> None:
    with live_server.client() as c:
        posted = upload_bytes(c, "t", write_bundle(tmp_path / "a.bundle", OPS).read_bytes()).json()
        got = c.get(f"/api/v1/bundles/{posted['id']}").json()
        listed = c.get("/api/v1/projects/t/bundles").json()["data"][0]
        assert posted["created_at"].endswith("Z") and got["created_at"] == posted["created_at"] == listed["created_at"]
