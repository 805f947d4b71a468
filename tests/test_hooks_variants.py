"""Variants keep module paths: fp32, int8 and fp8 captures have the same module record keys."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from accuracy.bundle import Bundle
from hooks import demo_model, run_capture
from hooks.fp8 import FP8Linear
from hooks.variants import VARIANTS, apply_variant


@pytest.fixture(scope="module")
def variant_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Bundle]:
    out = tmp_path_factory.mktemp("variants")
    return {v: Bundle.open(run_capture("hooks.demo_model:build", out / f"{v}.bundle", device="cpu", variant=v,
                                       mode="summary", progress=False))
            for v in VARIANTS}


def test_fp8_variants_listed() -> None:
    assert {"fp8-e4m3", "fp8-e5m2"} <= set(VARIANTS)


def test_module_keys_align_across_variants(variant_bundles: dict[str, Bundle]) -> None:
    keys = {v: sorted(r.id for r in b.records if r.kind == "module") for v, b in variant_bundles.items()}
    assert keys["fp32"], "no module records"
    for v in VARIANTS:
        assert keys[v] == keys["fp32"], v
    assert "model.layers.0.mlp.down_proj/forward#0" in keys["fp32"]


def test_fp8_run_notes_say_what_ran(variant_bundles: dict[str, Bundle]) -> None:
    for v in ("fp8-e4m3", "fp8-e5m2"):
        run = variant_bundles[v].manifest.run
        assert run["variant"] == v and "emulated" not in run
        assert "torch._scaled_mm" in run["quantization"] and "per-tensor" in run["quantization"]
        assert run["variant_coverage"]["replaced"] == run["variant_coverage"]["gemm_modules"] > 0
    assert "per-row" in variant_bundles["fp8-e4m3-rowwise"].manifest.run["quantization"]


def test_fp8_error_ordering(variant_bundles: dict[str, Bundle]) -> None:
    """e5m2 (2 mantissa bits) drifts further from fp32 than e4m3 (3 bits); both drift."""
    logits = {v: np.asarray(variant_bundles[v].record("/forward#0").stats.sample) for v in VARIANTS}  # type: ignore[union-attr]
    e4 = np.abs(logits["fp8-e4m3"] - logits["fp32"]).max()
    e5 = np.abs(logits["fp8-e5m2"] - logits["fp32"]).max()
    assert 0 < e4 < e5


def test_fp8_replaces_linears_in_place() -> None:
    model, inputs = demo_model.build()
    converted, _, notes = apply_variant(model, inputs, "fp8-e4m3", "cpu")
    assert isinstance(converted.model.layers[0].mlp.down_proj, FP8Linear)
    assert converted.model.layers[0].mlp.down_proj.weight_fp8.dtype == torch.float8_e4m3fn
    assert not [n for n, m in converted.named_modules() if type(m) is nn.Linear]


def test_unknown_variant_is_refused() -> None:
    model, inputs = demo_model.build()
    with pytest.raises(ValueError, match="variant must be one of"):
        apply_variant(model, inputs, "fp4", "cpu")


def test_aten_keys_of_fp32_and_bf16_match(tmp_path: Path) -> None:
    a = Bundle.open(run_capture("hooks.demo_model:build", tmp_path / "a.bundle", device="cpu", mode="summary"))
    b = Bundle.open(run_capture("hooks.demo_model:build", tmp_path / "b.bundle", device="cpu", variant="bf16",
                                mode="summary"))
    assert {r.id for r in a.records if r.op == "aten.mm"} == {r.id for r in b.records if r.op == "aten.mm"}
