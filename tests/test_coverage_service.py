"""Coverage per project in the service: GET /projects/{p}/coverage and the /coverage dashboard page."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from service_fixtures import LiveServer, wait_done

from hooks.opsweep import OpSpec, SweepConfig, run_sweep

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def sweep_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cfg = SweepConfig(ops=[OpSpec("softmax"), OpSpec("rsqrt")], dtypes=["bf16"], regimes=["normal", "subnormal"])
    result = run_sweep(cfg, tmp_path_factory.mktemp("sweep"), progress=False)
    return {"ref": result.reference, "bf16": result.targets["bf16"]}


def _upload_and_compare(c: httpx.Client, project: str, pairs: list[tuple[Path, Path, str]]) -> None:
    for ref, tgt, mode in pairs:
        ids = [c.post(f"/api/v1/projects/{project}/bundles", content=p.read_bytes()).json()["id"] for p in (ref, tgt)]
        r = c.post(f"/api/v1/projects/{project}/comparisons", json={"reference": ids[0], "target": ids[1], "mode": mode})
        assert wait_done(c, r.json()["id"])["status"] == "done"


def test_project_coverage_over_demo_runs_and_a_sweep(live_server: LiveServer, demo_bundles: dict[str, Path],
                                                     sweep_bundles: dict[str, Path]) -> None:
    with live_server.client() as c:
        _upload_and_compare(c, "cov", [(demo_bundles["ref"], demo_bundles["bf16"], "propagated"),
                                       (sweep_bundles["ref"], sweep_bundles["bf16"], "replay")])
        r = c.get("/api/v1/projects/cov/coverage", params={"op": ["aten.mm", "aten.rsqrt", "aten._softmax", "aten.conv2d"]})
        assert r.status_code == 200, r.text
        cov = r.json()
        assert cov["schema"] == "opband.coverage/1" and "sweep" in cov["models"] and len(cov["models"]) == 2
        ops = {o["op"]: o for o in cov["ops"]}
        total = ops["aten.rsqrt"]["models"]["sweep"]
        assert total["regimes"] == ["normal", "subnormal"] and total["dtypes"] == ["bfloat16", "float32"]
        assert total["state"] == "FAIL 1/2" and total["bands"] == {"budget": 2}
        demo = next(m for m in cov["models"] if m != "sweep")
        assert ops["aten.mm"]["models"][demo]["state"].startswith("pass")
        assert ops["aten.mm"]["models"][demo]["dtypes"] == ["bfloat16", "float32"]
        assert cov["op_list"]["covered"] == ["aten.mm", "aten.rsqrt", "aten._softmax"]
        assert cov["op_list"]["uncovered"] == ["aten.conv2d"] and cov["op_list"]["share"] == 0.75
        assert c.get("/api/v1/projects/nope/coverage").status_code == 404
        page = c.get("/coverage")
        assert page.status_code == 200 and "/static/coverage.js" in page.text


@pytest.mark.browser
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_coverage_page_in_the_browser(live_server: LiveServer, demo_bundles: dict[str, Path],
                                      sweep_bundles: dict[str, Path], artifacts_dir: Path) -> None:
    from playwright.sync_api import sync_playwright

    with live_server.client() as c:
        _upload_and_compare(c, "covweb", [(demo_bundles["ref"], demo_bundles["int8"], "propagated"),
                                          (sweep_bundles["ref"], sweep_bundles["bf16"], "replay")])
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{live_server.url}/coverage?project=covweb")
        page.wait_for_selector("#matrix tbody tr", timeout=30_000)
        assert page.locator("#matrix thead th").count() == 3  # op + two models
        row = page.locator("#matrix tbody tr", has_text="aten.rsqrt")
        assert row.locator(".badge.fail").inner_text() == "FAIL 1/2"
        page.fill("#oplist", "aten.rsqrt, aten.conv2d")
        page.click("#apply")
        page.wait_for_function("document.getElementById('share').textContent.includes('1/2')", timeout=30_000)
        assert page.locator("#uncovered").inner_text() == "uncovered: aten.conv2d"
        page.screenshot(path=str(artifacts_dir / "coverage.png"), full_page=True)
        browser.close()
    assert not errors, errors
