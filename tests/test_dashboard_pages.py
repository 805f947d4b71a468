"""Every dashboard page in headless Chromium (Debian's /usr/bin/chromium) driven by Playwright.

One server with auth on holds two projects: ``demo`` (captures of the demo decoder: fp32 with 2
and 1 threads, bf16, int8, and fp32 with a fast-sigmoid bug injected) and ``synth`` (synthetic bundles: six quiet fp32 runs promoted into
baseline ``main`` so the band exists, then a run where op 3 drifts, which op 5 inherits). Each
page is reached by its permalink and checked against the API's own numbers; screenshots of every
page go to test-artifacts/.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from service_fixtures import LiveServer, SynthOp, create_token, start_server, stop_server, wait_done, write_bundle

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
#: the synthetic model: op 3 drifts in the last run, op 5 carries its error downstream (inherited)
SYNTH_OPS = [SynthOp(f"model.layers.{i}.mlp", shape=(256,)) for i in range(8)]
QUIET, DRIFT = 2e-7, 3e-2
KEY3 = "model.layers.3.mlp/aten.mm#0"


@dataclass
class Site:
    server: LiveServer
    write: str  # write token of project synth
    read: str  # read-only token of project synth
    ids: dict[str, str]  # comparison ids: demo_threads, demo_bf16, demo_int8, demo_bug, synth_quiet_0..5, synth_drift


#: demo runs' names (label, target name, tags), given at upload as `opband upload --label --target --tag` does
DEMO_NAMES = {
    "ref": ("fp32-2threads", "cpu/fp32", ["branch=main"]),
    "ref2": ("fp32-1thread", "cpu/fp32", ["branch=main"]),
    "bf16": ("bf16-nightly", "cpu/bf16", ["branch=main"]),
    "int8": ("int8-nightly", "cpu/int8", ["branch=main"]),
    "bug": ("fast-sigmoid", "cpu/fp32-fastmath", ["branch=feature/fast-sigmoid", "op-library=fastmath-0.1"]),
}


def _upload(c: httpx.Client, project: str, path: Path, token: str, names: tuple[str, str, list[str]] | None = None) -> str:
    params = {"label": names[0], "target": names[1], "tag": names[2]} if names else None
    r = c.post(f"/api/v1/projects/{project}/bundles", content=path.read_bytes(), params=params,
               headers={"Authorization": f"Bearer {token}"})
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def _compare(c: httpx.Client, project: str, ref: str, tgt: str, token: str) -> str:
    r = c.post(f"/api/v1/projects/{project}/comparisons", json={"reference": ref, "target": tgt},
               headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 202, r.text
    assert wait_done(c, r.json()["id"])["status"] == "done"
    return str(r.json()["id"])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, demo_bundles: dict[str, Path]) -> Iterator[Site]:
    from hooks import run_capture

    tmp = tmp_path_factory.mktemp("dashboard")
    bug = run_capture("hooks.demo_faults:build_fast_sigmoid_bug", tmp / "bug.bundle", device="cpu")
    specs = Path(__file__).parent / "generation_specs.py"
    gen = {k: run_capture(f"{specs}:{fn}", tmp / f"gen-{k}.bundle", device="cpu", generate=8)
           for k, fn in (("ref", "llama"), ("bug", "llama_positions_bug"))}
    server = start_server(tmp / "data", f"sqlite:///{tmp / 'opband.db'}", {"OPBAND_AUTH": "true"})
    try:
        write = create_token(server, "demo")
        synth_token = create_token(server, "synth")
        read = create_token(server, "synth", read_only=True)
        ids: dict[str, str] = {}
        auth = {"Authorization": f"Bearer {write}"}
        with server.client() as c:
            assert c.patch("/api/v1/projects/demo", json={"public": True}, headers=auth).status_code == 200
            assert c.patch("/api/v1/projects/synth", json={"public": True},
                           headers={"Authorization": f"Bearer {synth_token}"}).status_code == 200
            b = {k: _upload(c, "demo", demo_bundles[k], write, DEMO_NAMES[k]) for k in ("ref", "ref2", "bf16", "int8")}
            b["bug"] = _upload(c, "demo", bug, write, DEMO_NAMES["bug"])
            ids["demo_threads"] = _compare(c, "demo", b["ref"], b["ref2"], write)
            ids["demo_bf16"] = _compare(c, "demo", b["ref"], b["bf16"], write)
            ids["demo_int8"] = _compare(c, "demo", b["ref"], b["int8"], write)
            ids["demo_bug"] = _compare(c, "demo", b["ref"], b["bug"], write)
            gen_token = create_token(server, "generation")
            assert c.patch("/api/v1/projects/generation", json={"public": True},
                           headers={"Authorization": f"Bearer {gen_token}"}).status_code == 200
            g = {k: _upload(c, "generation", path, gen_token, (f"gen {k}", "llama-generate", []))
                 for k, path in gen.items()}
            ids["generation"] = _compare(c, "generation", g["ref"], g["bug"], gen_token)
            ref = _upload(c, "synth", write_bundle(tmp / "ref.bundle", SYNTH_OPS), synth_token)
            assert c.post("/api/v1/projects/synth/baselines", json={"name": "main"},
                          headers={"Authorization": f"Bearer {synth_token}"}).status_code == 201
            for i in range(6):
                ops = [SynthOp(o.module, shape=o.shape, noise=QUIET) for o in SYNTH_OPS]
                tgt = _upload(c, "synth", write_bundle(tmp / f"quiet{i}.bundle", ops, target=True, seed=i,
                                                      environment={"threads": 2}), synth_token)
                ids[f"synth_quiet_{i}"] = cid = _compare(c, "synth", ref, tgt, synth_token)
                r = c.post("/api/v1/projects/synth/baselines/main/comparisons", json={"comparison": cid},
                           headers={"Authorization": f"Bearer {synth_token}"})
                assert r.status_code == 200, r.text
            ops = [SynthOp(o.module, shape=o.shape, noise=DRIFT if i in (3, 5) else QUIET) for i, o in enumerate(SYNTH_OPS)]
            tgt = _upload(c, "synth", write_bundle(tmp / "drift.bundle", ops, target=True, seed=9,
                                                  environment={"threads": 4, "torch": "2.14.0"}), synth_token)
            ids["synth_drift"] = _compare(c, "synth", ref, tgt, synth_token)
            ops = [SynthOp(o.module, shape=o.shape, noise=0.3 if i == 6 else QUIET) for i, o in enumerate(SYNTH_OPS)]
            tgt = _upload(c, "synth", write_bundle(tmp / "bf16.bundle", ops, target=True, seed=10, variant="bf16"),
                          synth_token)
            ids["synth_bf16"] = _compare(c, "synth", ref, tgt, synth_token)
        yield Site(server, synth_token, read, ids)
    finally:
        stop_server(server)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian chromium must be installed (.ci/run and make test install it)"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, site: Site):  # type: ignore[no-untyped-def]
    """A fresh page (no token saved) that fails the test on any script error or external request."""
    context = browser.new_context(viewport={"width": 1440, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" and "status of 40" not in m.text else None)
    pg.on("request", lambda r: errors.append("external request " + r.url)
          if not r.url.startswith((site.server.url, "data:", f"blob:{site.server.url}")) else None)
    pg.errors = errors
    yield pg
    context.close()
    assert not errors, errors


def _api(site: Site, path: str) -> dict:  # type: ignore[type-arg]
    with site.server.client() as c:
        r = c.get("/api/v1" + path)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


def _shot(pg, artifacts: Path, name: str, full_page: bool = True) -> None:  # type: ignore[no-untyped-def]
    pg.wait_for_timeout(300)
    pg.screenshot(path=str(artifacts / f"dashboard-{name}.png"), full_page=full_page)


def test_overview_targets_regressions_and_drift_include_first_divergences(site: Site, page, artifacts_dir: Path) -> None:
    ov = _api(site, "/projects/demo/overview")
    assert [(t["target"], t["label"]) for t in ov["targets"]] == [
        ("cpu/bf16", "bf16-nightly"), ("cpu/fp32", "fp32-1thread"), ("cpu/fp32-fastmath", "fast-sigmoid"),
        ("cpu/int8", "int8-nightly")]
    page.goto(f"{site.server.url}/#/p/demo")
    page.wait_for_function("window.opbandDriftKeys !== undefined", timeout=30_000)
    for t in ov["targets"]:
        row = page.locator(f"#targets tr[data-target='{t['target']}']")
        assert row.locator(".badge").first.inner_text() == t["verdict"]
    assert page.locator("#open-count").inner_text() == str(ov["open_regressions"])
    assert page.locator("#comparisons tbody tr").count() == 4
    # the default drift view holds the first divergence of every comparison and every open regression
    drift_keys = set(page.evaluate("window.opbandDriftKeys"))
    first_divs = {_api(site, f"/comparisons/{cid}")["first_divergence"]["key"]
                  for name, cid in site.ids.items() if name.startswith("demo")
                  if _api(site, f"/comparisons/{cid}")["first_divergence"]}
    assert first_divs and first_divs <= drift_keys, (first_divs, drift_keys)
    open_regs = _api(site, "/projects/demo/regressions?status=active,acknowledged&limit=1000")["data"]
    assert {g["key"] for g in open_regs} <= drift_keys
    plotted = page.evaluate("document.getElementById('drift').data.reduce((n, t) => n + t.y.filter(v => v !== null).length, 0)")
    assert plotted == page.evaluate("window.opbandDriftPoints") > 0
    _shot(page, artifacts_dir, "overview")
    # the old link form lands on the project's overview
    page.goto(f"{site.server.url}/?project=synth")
    page.wait_for_function("location.hash === '#/p/synth'")
    page.wait_for_selector("#targets tr[data-target='fp32@cpu']")
    page.goto(f"{site.server.url}/#/p/demo")
    page.wait_for_selector("#targets tr[data-target='cpu/fp32-fastmath']")
    # three clicks from the overview: comparison -> first divergence's op page
    page.locator("#targets tr[data-target='cpu/fp32-fastmath'] a[href^='#/comparison/']").click()
    page.wait_for_selector("#env-diff")
    assert "/comparison/" + site.ids["demo_bug"] in page.url
    assert page.locator(".run-card dd.label").all_inner_texts() == ["fp32-2threads", "fast-sigmoid"]
    assert "op library" in page.locator("#env-summary .chip").all_text_contents()  # from the runs' tags
    assert page.locator("#env-diff tr[data-category=code] code").all_inner_texts() == ["tags.branch"]
    _shot(page, artifacts_dir, "comparison-named")
    page.locator("#first-divergence").click()
    page.wait_for_function("window.opbandHistogram !== undefined", timeout=30_000)
    assert "/op/demo/" in page.url and "target=cpu%2Ffp32-fastmath" in page.url


def test_comparison_header_env_diff_filters_and_folding(site: Site, page, artifacts_dir: Path) -> None:
    cid = site.ids["demo_threads"]
    page.goto(f"{site.server.url}/#/comparison/{cid}")
    page.wait_for_selector("#ops tbody tr")
    # the only change between the two fp32 runs is the thread count
    assert page.locator("#env-summary .chip").all_text_contents() == ["threads"]
    assert page.locator("#env-diff tbody tr[data-category=threads] code").inner_text() == "environment.threads"
    # bf16: the variant is what changed, and every op is listed with paging
    bf = site.ids["demo_bf16"]
    page.goto(f"{site.server.url}/#/comparison/{bf}")
    page.wait_for_selector("#ops tbody tr")
    assert "dtype" in page.locator("#env-summary .chip").all_text_contents()
    total = _api(site, f"/comparisons/{bf}/ops?limit=1")["count"]
    assert page.locator("#ops-pager .range").inner_text().endswith(f"of {total}") or total <= 50
    # filter: verdict fail + search by part of the op key; the permalink keeps the filters
    fails = _api(site, f"/comparisons/{bf}/ops?verdict=fail&limit=1000")["data"]
    page.locator("#filters input[name=fold]").uncheck()
    page.locator("#filters input[value=fail]").check()
    page.wait_for_function(f"document.querySelector('#ops-count')?.textContent.startsWith('({len(fails)}')")
    assert all(b == "fail" for b in page.locator("#ops tbody tr td:first-child .badge").all_inner_texts())
    needle = fails[0]["key"].split("/")[0] if fails else "layers"
    page.fill("#filters input[name=search]", needle)
    want = [o["key"] for o in fails if needle in o["key"]]
    page.wait_for_function("location.hash.includes('search=')")
    page.wait_for_function(f"document.querySelector('#ops-count')?.textContent.startsWith('({len(want)}')")
    assert "search=" in page.url and "verdict=fail" in page.url
    page.reload()
    page.wait_for_function(f"document.querySelector('#ops-count')?.textContent.startsWith('({len(want)}')")
    assert page.locator("#filters input[name=search]").input_value() == needle
    # synth drift: op 5 inherits op 3's error and is folded under it
    page.goto(f"{site.server.url}/#/comparison/{site.ids['synth_drift']}")
    page.wait_for_selector("#ops tbody tr.root")
    root = page.locator("#ops tbody tr.root").first
    assert root.get_attribute("data-key") == "model.layers.3.mlp/aten.mm#0"
    child = page.locator("#ops tbody tr.child").first
    assert child.get_attribute("data-key") == "model.layers.5.mlp/aten.mm#0" and not child.is_visible()
    page.locator("#ops button[data-group]").first.click()
    assert child.is_visible()
    assert {"threads", "torch"} <= set(page.locator("#env-summary .chip").all_text_contents())
    _shot(page, artifacts_dir, "comparison")


def test_a_generations_comparison_shows_its_steps_and_the_step_that_diverged(site: Site, page, artifacts_dir: Path) -> None:
    """Rotary positions restart at 0 from decode step 4: the first divergence names that step and its token
    position; the step table shows the next-token KL rising there, from nothing before it."""
    cid = site.ids["generation"]
    gen = _api(site, f"/comparisons/{cid}")["generation"]
    assert gen is not None and len(gen["steps"]) == 8
    page.goto(f"{site.server.url}/#/comparison/{cid}")
    page.wait_for_selector("#generation tbody tr")
    assert page.locator("#generation tbody tr").count() == 8
    prompt = 6
    assert page.locator("#fd-step").inner_text() == f"at step 4 (decode, token position {prompt + 4})"
    kl = [st["kl"] for st in gen["steps"]]
    assert max(kl[:4]) < 1e-6 < 1e-3 < kl[4], kl
    cells = page.locator("#generation tbody tr").nth(4).locator("td").all_inner_texts()
    assert cells[:2] == ["4", str(prompt + 4)] and cells[5] != "0"
    _shot(page, artifacts_dir, "comparison-generation")


def test_op_page_history_band_budget_histogram_and_stats(site: Site, page, artifacts_dir: Path) -> None:
    key = "model.layers.3.mlp/aten.mm#0"
    assert len(_api(site, f"/projects/synth/op-history?key={quote(key)}")["series"]) == 2  # fp32@cpu, bf16@cpu
    hist = _api(site, f"/projects/synth/op-history?key={quote(key)}&target=fp32@cpu")
    (series,) = hist["series"]
    pts = series["points"]
    assert len(pts) == 7 and pts[-1]["out"] and not any(p["out"] for p in pts[:-1])
    assert pts[-1]["band"] is not None and pts[-1]["value"] > pts[-1]["band"]  # learned from the 6 accepted runs
    assert pts[0]["band"] is None  # no accepted history yet
    page.goto(f"{site.server.url}/#/op/synth/{quote(key, safe='')}?target=fp32%40cpu&run={site.ids['synth_drift']}")
    page.wait_for_function("window.opbandHistogram !== undefined", timeout=30_000)
    drawn = page.evaluate("window.opbandHistory")
    assert len(drawn) == 1 and drawn[0]["values"] == [p["value"] for p in pts] and drawn[0]["out"] == 1
    assert drawn[0]["band"] == [p["band"] for p in pts] and drawn[0]["budget"] == [p["budget"] for p in pts]
    fills = page.evaluate("document.getElementById('history-0').data.filter(t => t.fill === 'tonexty').map(t => t.name)")
    assert fills == ["budget", "band"]
    symbols = page.evaluate("document.getElementById('history-0').data.find(t => t.name === 'norm_l2').marker.symbol")
    assert symbols[-1] == "x" and set(symbols[:-1]) == {"circle"}
    detail = _api(site, f"/comparisons/{site.ids['synth_drift']}/op?key={quote(key)}")
    assert sum(b["count"] for b in page.evaluate("window.opbandHistogram")) == 256 == \
        sum(b["count"] for b in detail["histogram"])
    # reference vs target statistics: same numel, the target's spread grown by the injected noise
    assert page.locator("#stats tr[data-stat=numel] td").first.inner_text() == "256"
    assert detail["reference_stats"]["numel"] == detail["target_stats"]["numel"] == 256
    assert page.locator("#accepted tbody tr").count() == 6
    assert page.locator("#run-title .badge").inner_text() == "fail"
    assert page.locator("#op-target option").all_inner_texts()[1:] == ["bf16@cpu", "fp32@cpu"]  # filtered, all listed
    _shot(page, artifacts_dir, "op")
    # clicking an earlier point selects that run
    page.goto(f"{site.server.url}/#/op/synth/{quote(key, safe='')}?target=fp32%40cpu&run={site.ids['synth_quiet_0']}")
    page.wait_for_function("document.querySelector('#run-title .badge')?.textContent === 'pass'")


def test_heatmap_renders_the_apis_cells(site: Site, page, artifacts_dir: Path) -> None:
    hm = _api(site, "/projects/synth/heatmap?runs=30&ops=60")
    assert [r["comparison_id"] for r in hm["runs"]] == [site.ids[f"synth_quiet_{i}"] for i in range(6)] + [
        site.ids["synth_drift"], site.ids["synth_bf16"]]
    assert [o["key"] for o in hm["ops"]] == [f"model.layers.{i}.mlp/aten.mm#0" for i in range(8)]  # execution order
    over = {(hm["ops"][i]["key"][13], j) for i, row in enumerate(hm["z"]) for j, v in enumerate(row) if v > 1}
    assert over == {("3", 6), ("5", 6), ("6", 7)}  # the drifted ops, in the runs where they drifted
    page.goto(f"{site.server.url}/#/p/synth/heatmap")
    page.wait_for_function("window.opbandHeatmap !== undefined")
    data = page.evaluate("document.getElementById('heatmap').data[0]")
    assert data["y"] == [o["key"] for o in hm["ops"]]
    drawn = {(data["y"][i][13], j) for i, row in enumerate(data["z"]) for j, v in enumerate(row) if v > 0}
    assert drawn == over  # log10(severity) > 0 exactly where the API says the op was out of band
    assert page.evaluate("window.opbandHeatmap") == {"runs": 8, "ops": 8, "cells": 64}
    page.select_option("#hm-order", "similar")  # ops that move together side by side: 3 and 5 drifted together
    page.wait_for_function("location.hash.includes('order=similar')")
    page.wait_for_function("document.getElementById('heatmap').data[0].y.join() !== %r" % ",".join(data["y"]))
    rows = page.evaluate("document.getElementById('heatmap').data[0].y")
    assert abs(rows.index(KEY3) - rows.index("model.layers.5.mlp/aten.mm#0")) == 1
    _shot(page, artifacts_dir, "heatmap")
    page.evaluate("window.opbandHeatmap = undefined")
    page.goto(f"{site.server.url}/#/p/synth/heatmap?order=similar")  # the permalink keeps the row order
    page.wait_for_function("window.opbandHeatmap !== undefined")
    assert page.evaluate("document.getElementById('heatmap').data[0].y") == rows
    # a cell opens that op's page at that run (Plotly's click event, as a click on the cell emits it)
    page.evaluate("el => el.emit('plotly_click', {points: [{y: %r, pointNumber: [%d, 6]}]})" % (KEY3, rows.index(KEY3)),
                  page.locator("#heatmap").element_handle())
    page.wait_for_function("location.hash.startsWith('#/op/synth/')")
    assert f"run={site.ids['synth_drift']}" in page.url and "target=fp32%40cpu" in page.url


def test_regression_actions_need_a_write_token_and_are_audited(site: Site, page, artifacts_dir: Path) -> None:
    page.goto(f"{site.server.url}/#/p/synth/regressions")
    page.wait_for_selector("#regressions tbody tr[data-id]")
    assert page.locator("#regressions tbody tr[data-status=active]").count() == 2  # op 3 (fp32), op 6 (bf16)
    row = page.locator("#regressions tbody tr[data-status=active]").first
    rid = row.get_attribute("data-id")
    row.locator("button[data-act=acknowledged]").click()
    page.wait_for_selector("#reg-notice .notice.error")
    assert "needs a token" in page.locator("#reg-notice").inner_text()
    # a read-only token: refused with the API's words
    page.locator("#settings summary").click()
    page.fill("#token", site.read)
    page.fill("#author", "ana")
    page.locator("#settings-form button").click()
    page.wait_for_selector(f"#regressions tbody tr[data-id='{rid}']")
    page.locator(f"#regressions tbody tr[data-id='{rid}'] button[data-act=acknowledged]").click()
    page.wait_for_selector("#reg-notice .notice.error")
    assert "read-only" in page.locator("#reg-notice").inner_text()
    assert _api(site, "/projects/synth/regressions?status=active")["count"] == 2
    # a write token: acknowledged, and the audit says who
    page.locator("#settings summary").click()
    page.fill("#token", site.write)
    page.locator("#settings-form button").click()
    page.wait_for_selector(f"#regressions tbody tr[data-id='{rid}']")
    page.locator(f"#regressions tbody tr[data-id='{rid}'] button[data-act=acknowledged]").click()
    page.wait_for_selector("#reg-notice .notice.ok")
    regs = {g["id"]: g for g in _api(site, "/projects/synth/regressions?status=acknowledged")["data"]}
    assert regs[int(rid)]["status"] == "acknowledged"
    audit = _api(site, "/projects/synth/regression-events")["data"]
    assert audit[0]["regression_id"] == int(rid) and audit[0]["actor"] == "ana" and audit[0]["status"] == "acknowledged"
    page.wait_for_selector("#audit tbody tr td:nth-child(2)")
    assert page.locator("#audit tbody tr").first.locator("td").nth(1).inner_text() == "ana"
    # accept another one with an expiry: it becomes accepted, and the deviation lists its expiry
    other = page.locator("#regressions tbody tr[data-status=active]").first
    oid = other.get_attribute("data-id")
    other.locator("button[data-act=accept-form]").click()
    form = page.locator(f"#accept-{oid} form")
    form.locator("input[name=expires]").fill("2099-01-31")
    form.locator("input[name=reason]").fill("rounding of this op on the new target is expected")
    form.locator("button").click()
    page.wait_for_selector("#reg-notice .notice.ok")
    accepted = {g["id"]: g for g in _api(site, "/projects/synth/regressions?status=accepted")["data"]}
    assert int(oid) in accepted
    devs = _api(site, "/projects/synth/deviations")["data"]
    assert devs[0]["expires_at"].startswith("2099-01-31") and devs[0]["author"] == "ana"
    page.wait_for_selector("#deviations tbody tr button[data-withdraw]")
    _shot(page, artifacts_dir, "regressions")


def test_baselines_page_lists_and_promotes(site: Site, page, artifacts_dir: Path) -> None:
    page.goto(f"{site.server.url}/#/p/synth/baselines")
    page.wait_for_selector(".baseline[data-name=main]")
    assert page.locator(".baseline[data-name=main] tbody tr").count() == 6
    page.locator("#bl-promote select[name=comparison]").select_option(site.ids["synth_drift"])
    page.locator("#bl-promote button").click()
    page.wait_for_selector("#bl-notice .notice.error")  # no token: refused with the API's message
    assert "token" in page.locator("#bl-notice").inner_text()
    _shot(page, artifacts_dir, "baselines")


def test_api_docs_load_offline(site: Site, page, artifacts_dir: Path) -> None:
    """/docs and /redoc render from packaged assets: the page fixture fails on any external request."""
    page.goto(f"{site.server.url}/docs")
    page.wait_for_selector(".swagger-ui .opblock", timeout=30_000)
    assert page.locator(".opblock-summary-path", has_text="/api/v1/projects/{project}/op-history").count() == 1
    _shot(page, artifacts_dir, "swagger", full_page=False)
    page.goto(f"{site.server.url}/redoc")
    page.wait_for_selector("redoc [role=navigation], .menu-content", timeout=30_000)
    assert re.search(r"op-history|Op History", page.content())
    _shot(page, artifacts_dir, "redoc", full_page=False)
