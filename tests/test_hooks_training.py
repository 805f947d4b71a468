"""``opband capture --backward``: gradients and parameter updates of training steps, compared.

A wrong backward kernel (the activation's gradient 1% too large, its forward exact) leaves every
forward record equal; the comparison must name the first diverging gradient: the gradient that
leaves the faulty activation (``fc1/backward#0``, the gradient w.r.t. fc1's output), not the one
that enters it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import accuracy
from accuracy.bundle import Bundle
from accuracy.report import to_text
from hooks import run_capture

HERE = Path(__file__).parent
SPECS = str(HERE / "training_specs.py")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("train")
    return {name: run_capture(f"{SPECS}:{spec}", out / f"{name}.bundle", device="cpu", backward=True,
                              train_steps=2, lr=0.1, progress=False)
            for name, spec in (("ref", "mlp"), ("bad", "mlp_bad_grad"))}


def test_gradients_and_updates_recorded_per_step(runs: dict[str, Path]) -> None:
    b = Bundle.open(runs["ref"])
    run = b.manifest.run
    assert run["training"]["steps"] == 2 and run["training"]["optimizer"] == "sgd"
    assert run["steps"]["seen"] == 3  # two steps ended by cap.step()
    grads = {(r.step, r.module, r.op) for r in b.records if r.kind == "grad"}
    for step in (0, 1):
        for m in ("fc1", "fc2"):
            assert {(step, m, "grad.weight"), (step, m, "grad.bias"), (step, m, "update.weight"),
                    (step, m, "backward")} <= grads
    # SGD: the update is -lr x the gradient of that step
    for step in (0, 1):
        g = next(r for r in b.records if r.step == step and r.id.startswith("fc2/grad.weight"))
        u = next(r for r in b.records if r.step == step and r.id.startswith("fc2/update.weight"))
        np.testing.assert_allclose(b.record_values(u.id), -0.1 * b.record_values(g.id), rtol=1e-5, atol=1e-7)
    losses = run["training"]["losses"]
    assert losses[1] < losses[0]  # it trained


def test_first_diverging_gradient_is_named(runs: dict[str, Path]) -> None:
    report = accuracy.compare(runs["ref"], runs["bad"])
    assert report.verdict == "fail"
    step0_fwd = [o for o in report.ops if o.kind != "grad" and o.index < min(
        x.index for x in report.ops if x.kind == "grad")]
    assert step0_fwd and all(o.verdict == "pass" for o in step0_fwd)  # the forward of step 0 is exact
    g = report.first_gradient_divergence
    assert g is not None and g.id == "fc1/backward#0"
    assert report.first_divergence is not None and report.first_divergence.id == "fc1/backward#0"
    ok = {o.id: o.verdict for o in report.ops}
    assert ok["act/backward#0"] == "pass" and ok["fc2/grad.weight#0"] == "pass"  # upstream of the fault
    text = to_text(report)
    assert "first divergence: fc1/backward#0" in text


def test_model_own_loss(tmp_path: Path) -> None:
    """A Hugging Face model given labels returns .loss: no loss function needed."""
    pytest.importorskip("transformers")
    b = Bundle.open(run_capture(f"{SPECS}:gpt2_own_loss", tmp_path / "gpt2.bundle", device="cpu", backward=True,
                                level="module", progress=False))
    params = {r.module for r in b.records if r.op == "grad.weight"}
    assert "transformer.h.1.mlp.c_fc" in params and "transformer.wte" in params
    assert b.manifest.run["training"]["loss"] == "model output"


def test_backward_without_a_loss_says_what_to_do_on_the_cli(tmp_path: Path) -> None:
    spec = tmp_path / "noloss.py"
    spec.write_text("import torch\ndef build():\n    return torch.nn.Linear(2, 3), (torch.randn(4, 2),)\n")
    r = subprocess.run([str(Path(sys.executable).parent / "opband"), "capture", f"{spec}:build", "-o",
                        str(tmp_path / "x.bundle"), "--backward"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "needs a scalar loss" in r.stderr and "Traceback" not in r.stderr
