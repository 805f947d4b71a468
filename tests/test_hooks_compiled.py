"""Compiled targets: torch.compile (Inductor's C++ backend on CPU) per block, compared with eager.

Compiling whole blocks keeps their boundaries: each decoder layer's output is recorded as in
eager mode and pairs with the eager reference by key; the ops outside the blocks (embedding, final
norm, lm_head) are recorded as ATen ops; nothing inside a block is recorded or reported missing.
A fault inside a compiled layer is named at that layer's output.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import accuracy
from accuracy.bundle import Bundle
from hooks import run_capture
from hooks.compiled import compile_blocks, default_blocks
from hooks.demo_model import build

SPECS = str(Path(__file__).parent / "compile_specs.py")
BLOCKS = ["model.layers.0", "model.layers.1"]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("gcc") is None,
                                reason="Inductor's CPU backend needs a C++ compiler")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("compiled")
    return {
        "eager": run_capture(f"{SPECS}:tiny_decoder", out / "eager.bundle", device="cpu", progress=False),
        "compiled": run_capture(f"{SPECS}:tiny_decoder", out / "compiled.bundle", device="cpu", compile=True,
                                progress=False),
        "fault": run_capture(f"{SPECS}:tiny_decoder_fault", out / "fault.bundle", device="cpu", compile=True,
                             progress=False),
    }


def test_default_blocks_are_the_repeated_layers() -> None:
    model, _ = build()
    assert default_blocks(model) == [f"model.layers.{i}" for i in range(4)]
    assert default_blocks(torch.nn.Linear(2, 2)) == [""]


def test_compile_settings_in_manifest_and_block_outputs_recorded(runs: dict[str, Path]) -> None:
    b = Bundle.open(runs["compiled"])
    comp = b.manifest.run["compile"]
    assert comp["backend"] == "inductor" and comp["blocks"] == BLOCKS and comp["dynamic"] is False
    assert {r.id for r in b.records if r.kind == "module" and r.module in BLOCKS} == \
        {f"{m}/forward#0" for m in BLOCKS}
    inside = [r.id for r in b.records if any(r.module.startswith(m) for m in BLOCKS) and r.kind != "module"]
    assert inside == []  # Inductor's fused kernels are not ATen ops: nothing recorded inside a block
    assert any(r.op == "aten.embedding" for r in b.records)  # eager parts keep their ops
    assert not b.manifest.diagnostics


def test_compiled_target_pairs_with_eager_reference(runs: dict[str, Path]) -> None:
    report = accuracy.compare(runs["eager"], runs["compiled"])
    assert report.verdict == "pass", [(o.id, o.reason) for o in report.ops if o.verdict != "pass"]
    assert not report.unmatched  # the reference's records inside the blocks are not reported missing
    layers = {o.id: o for o in report.ops if o.module in BLOCKS}
    assert set(layers) == {f"{m}/forward#0" for m in BLOCKS}
    assert all(o.aligned_by == "key" and o.metrics is not None for o in layers.values())
    assert layers["model.layers.1/forward#0"].metrics.max_abs < 1e-4  # type: ignore[union-attr]


def test_fault_inside_a_compiled_block_is_named_at_its_output(runs: dict[str, Path]) -> None:
    report = accuracy.compare(runs["eager"], runs["fault"])
    assert report.verdict == "fail"
    fd = report.first_divergence
    assert fd is not None and fd.id == "model.layers.1/forward#0"
    layer0 = next(o for o in report.ops if o.id == "model.layers.0/forward#0")
    assert layer0.verdict == "pass"


def test_compile_blocks_keeps_module_objects_and_numerics() -> None:
    model, (ids,) = build()
    layer = model.model.layers[0]
    with torch.no_grad():
        ref = model(ids)
    model, notes = compile_blocks(model, blocks=["model.layers.0"])
    assert model.model.layers[0] is layer and notes["blocks"] == ["model.layers.0"]
    with torch.no_grad():
        assert torch.allclose(model(ids), ref, atol=1e-4)
