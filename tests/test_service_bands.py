"""Bands learned from a baseline's accepted comparisons judge new comparisons in the service."""

from __future__ import annotations

from pathlib import Path

import pytest
from service_fixtures import LiveServer, wait_done

SMALL_FAULT_SPEC = '''
import torch
from hooks.demo_model import build as _build

def build():
    model, inputs = _build()
    with torch.no_grad():
        model.model.layers[2].mlp.up_proj.weight[5, 9] += 0.5  # small: inside the default bf16 budget
    return model, inputs
'''


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_baseline_history_tightens_the_budget(live_server: LiveServer, demo_bundles: dict[str, Path],
                                              tmp_path: Path) -> None:
    from hooks import run_capture

    spec = tmp_path / "small_fault.py"
    spec.write_text(SMALL_FAULT_SPEC)
    # without fingerprints the edited weight is not a parameter finding: the fault stands for a kernel whose
    # output is slightly off, the case a learned band must catch and a default budget lets through
    faulty = run_capture(f"{spec}:build", tmp_path / "faulty-bf16.bundle", device="cpu", variant="bf16",
                         fingerprints=False)
    with live_server.client() as c:
        def up(project: str, path: Path) -> str:
            return c.post(f"/api/v1/projects/{project}/bundles", content=path.read_bytes()).json()["id"]  # type: ignore[no-any-return]

        def run(project: str, ref: str, tgt: str) -> dict:  # type: ignore[type-arg]
            r = c.post(f"/api/v1/projects/{project}/comparisons", json={"reference": ref, "target": tgt})
            return wait_done(c, r.json()["id"])

        ref, bf16, bad = up("banded", demo_bundles["ref"]), up("banded", demo_bundles["bf16"]), up("banded", faulty)
        assert c.post("/api/v1/projects/banded/baselines", json={"name": "main"}).status_code == 201
        for _ in range(6):  # six accepted runs of the healthy bf16 target: a bitwise-stable history
            done = run("banded", ref, bf16)
            assert done["verdict"] != "fail", done
            r = c.post("/api/v1/projects/banded/baselines/main/comparisons", json={"comparison": done["id"]})
            assert r.status_code == 200, r.text

        healthy = run("banded", ref, bf16)
        assert healthy["verdict"] != "fail", "the accepted target itself must stay in band"
        judged = c.get(f"/api/v1/comparisons/{healthy['id']}/ops", params={"limit": 5}).json()["data"]
        assert any("accepted" in o["reason"] or "band" in o["reason"] for o in judged), judged[0]["reason"]

        changed = run("banded", ref, bad)
        assert changed["verdict"] == "fail", changed
        assert changed["first_divergence"]["key"].startswith("model.layers.2.mlp.up_proj/"), changed["first_divergence"]

        # the same faulty target in a project without history passes its default budget
        ref_nb, bad_nb = up("nobands", demo_bundles["ref"]), up("nobands", faulty)
        assert run("nobands", ref_nb, bad_nb)["verdict"] != "fail"
