"""The dashboard in headless Chromium (Debian's /usr/bin/chromium) driven by Playwright."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from service_fixtures import LiveServer, wait_done

pytestmark = pytest.mark.browser
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_dashboard_shows_comparisons_and_drift(live_server: LiveServer, demo_bundles: dict[str, Path],
                                               artifacts_dir: Path) -> None:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian chromium must be installed (.ci/run and make test install it)"
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        ids = {k: c.post("/api/v1/projects/demo/bundles", content=demo_bundles[k].read_bytes()).json()["id"]
               for k in ("ref", "bf16", "int8", "ref2")}
        for tgt in ("ref2", "bf16", "int8"):
            r = c.post("/api/v1/projects/demo/comparisons", json={"reference": ids["ref"], "target": ids[tgt]})
            assert wait_done(c, r.json()["id"])["status"] == "done"
        drift = c.get("/api/v1/projects/demo/drift", params={"metric": "norm_l2", "series": 8, "points": 100}).json()
    api_points = sum(1 for s in drift for p in s["points"] if p["value"] is not None)
    assert api_points > 0

    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1100})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto(f"{live_server.url}/?project=demo")
        page.wait_for_function("window.opbandDriftPoints !== undefined", timeout=30_000)
        page.wait_for_selector("#ops tbody tr", timeout=30_000)
        rows = page.locator("#comparisons tbody tr")
        assert rows.count() == 3
        assert page.locator("#comparisons .badge.done").count() == 3
        chart_points = page.evaluate("window.opbandDriftPoints")
        plotted = page.evaluate("document.getElementById('drift').data.reduce((n, t) => n + t.y.length, 0)")
        assert chart_points == api_points == plotted, (chart_points, api_points, plotted)
        assert page.locator("#drift .scatterlayer .trace").count() == len(drift)
        # choosing the int8 comparison shows its worst ops
        page.locator("#comparisons tbody tr", has_text="int8@cpu").click()
        page.wait_for_function("document.querySelector('#ops tbody tr code')?.textContent.length > 0")
        assert page.locator("#ops tbody tr").count() == 15
        page.select_option("#metric", "max_abs")
        page.wait_for_function("document.getElementById('drift').layout.yaxis.title.text === 'max_abs'")
        page.select_option("#metric", "norm_l2")
        page.wait_for_timeout(500)
        page.screenshot(path=str(artifacts_dir / "dashboard.png"), full_page=True)
        browser.close()
    assert not errors, errors
