"""Quantizing variants reach every GEMM-like module of real models, with torch's real kernels.

GPT-2's projections are ``transformers`` ``Conv1D``, not ``nn.Linear``: ``int8`` once quantized
only its ``lm_head`` and the comparison passed. Here every variant must replace all 9 GEMM-like
modules of a 2-layer GPT-2, run its real kernel (seen as that op in an ATen capture), match a
hand-written dequantized computation, say what it replaced, and be refused when it would leave
most GEMM-like modules alone. A model quantized by another tool (torch.ao QAT fake-quant) aligns
module by module with the fp32 reference.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import accuracy
from accuracy.bundle import Bundle
from hooks import run_capture
from hooks.fp8 import FP8Linear, quantize
from hooks.gemm import Gemm, find_gemms
from hooks.quantize import W4A16Linear, W8A16Linear, int8_dynamic
from hooks.variants import QUANTIZED, VariantCoverageError, apply_variant

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

SPECS = str(Path(__file__).parent / "transformers_specs.py")
GPT2_GEMMS = {f"transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                      "mlp.c_proj")} | {"lm_head"}
#: the kernel each variant's replaced modules call, as it appears in an ATen capture
KERNEL = {"int8": "quantized.linear_dynamic", "w8a16": "aten._weight_int8pack_mm",
          "w4a16": "aten._weight_int4pack_mm_for_cpu", **{v: "aten._scaled_mm" for v in QUANTIZED if "fp8" in v}}


def _gpt2() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers_specs

    torch.manual_seed(0)
    return transformers_specs.gpt2()


@pytest.mark.parametrize("variant", list(QUANTIZED))
def test_every_gpt2_projection_is_replaced(variant: str) -> None:
    model, inputs = _gpt2()
    with torch.no_grad():
        ref = model(**inputs).logits
    q, q_inputs, notes = apply_variant(model, inputs, variant, "cpu")
    cov = notes["variant_coverage"]
    assert (cov["replaced"], cov["gemm_modules"]) == (9, 9)
    assert cov["by_type"] == {"Conv1D": {"found": 8, "replaced": 8}, "Linear": {"found": 1, "replaced": 1}}
    assert set(cov["replaced_names"]) == GPT2_GEMMS and cov["left_alone"] == []
    assert not find_gemms(q)[0], "nothing replaceable left"
    with torch.no_grad():
        out = q(**q_inputs).logits.float()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.3, rel  # quantized (not the fp32 numbers), not broken


@pytest.mark.parametrize("variant", ["int8", "w4a16", "fp8-e4m3-rowwise"])
def test_aten_capture_sees_the_real_kernel_in_every_projection(variant: str, tmp_path: Path) -> None:
    b = Bundle.open(run_capture(f"{SPECS}:gpt2", tmp_path / f"{variant}.bundle", device="cpu", variant=variant,
                                mode="summary", progress=False))
    mods = {r.module for r in b.records if r.op == KERNEL[variant]}
    assert mods == GPT2_GEMMS
    if "fp8" in variant:
        fp8_inputs = {d for r in b.records if r.op == "aten._scaled_mm" for d in r.input_dtypes[:2]}
        assert fp8_inputs == {"float8_e4m3fn"}
    assert b.manifest.run["variant_coverage"]["replaced"] == 9


def test_int8_comparison_shows_int8_errors_in_every_projection(tmp_path: Path) -> None:
    """The issue's scenario: fp32 vs int8 GPT-2 used to pass with every layer bit-identical."""
    ref = run_capture(f"{SPECS}:gpt2", tmp_path / "ref.bundle", device="cpu", level="module", progress=False)
    tgt = run_capture(f"{SPECS}:gpt2", tmp_path / "int8.bundle", device="cpu", variant="int8", level="module",
                      progress=False)
    report = accuracy.compare(ref, tgt)
    by_module = {o.module: o for o in report.ops if o.kind == "module"}
    for name in GPT2_GEMMS:
        m = by_module[name].metrics
        assert m is not None and m.norm_l2 > 1e-3, (name, m)  # int8 rounding, not fp32 noise (~1e-7)
    assert by_module["transformer.h.0.attn.c_attn"].metrics.norm_l2 < 0.05  # type: ignore[union-attr]


def _gemm(out_f: int = 24, in_f: int = 64, bias: bool = True) -> Gemm:
    g = torch.Generator().manual_seed(3)
    return Gemm("x", "Linear", torch.randn(out_f, in_f, generator=g),
                torch.randn(out_f, generator=g) if bias else None)


def test_w8a16_matches_dequantized_weight() -> None:
    g = _gemm()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    m = W8A16Linear(g)
    scale = g.weight.abs().amax(1) / 127
    deq = torch.round(g.weight / scale[:, None]).clamp(-128, 127) * scale.bfloat16().float()[:, None]
    expected = x.bfloat16().float() @ deq.t() + g.bias.bfloat16().float()
    out = m(x).float()
    assert out.dtype == torch.float32 and m.qweight.dtype == torch.int8
    assert torch.allclose(out, expected, rtol=2e-2, atol=2e-2)  # bf16 output rounding
    assert (out - x @ g.weight.t() - g.bias).abs().max() > 1e-3  # and it is not the fp32 product


def test_w4a16_groups_and_matches_dequantized_weight() -> None:
    g = _gemm(out_f=32, in_f=96, bias=False)  # 96: groups of 32 (not 128 or 64); the kernel wants N % 16 == 0
    m = W4A16Linear(g, act_dtype=torch.float32)
    assert m.group_size == 32
    w = g.weight.reshape(32, 3, 32)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = (hi - lo) / 15
    deq = (torch.round((w - lo) / scale).clamp(0, 15) * scale + lo).reshape(32, 96)
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(m(x), x @ deq.t(), atol=1e-4)
    assert len(torch.unique(torch.round((w - lo) / scale))) == 16  # 4 bits used
    with pytest.raises(ValueError, match="group size"):
        W4A16Linear(_gemm(in_f=40))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_fp8_runs_scaled_mm_on_float8_operands(dtype: torch.dtype, scaling: str) -> None:
    g = _gemm()
    x = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(6))
    m = FP8Linear(g, dtype, scaling)
    assert m.weight_fp8.dtype == dtype
    assert m.weight_scale.shape == ((1, 24) if scaling == "row" else ())
    qx, sx = quantize(x.reshape(12, 64), dtype, scaling == "row")
    assert sx.shape == ((12, 1) if scaling == "row" else ())
    # amax maps to the largest float8 code exactly
    assert qx.float().abs().amax() == torch.finfo(dtype).max
    expected = (qx.float() * sx) @ (m.weight_fp8.float() * m.weight_scale.reshape(-1, 1) if scaling == "row"
                                    else m.weight_fp8.float() * m.weight_scale).t() + g.bias
    out = m(x)
    assert out.shape == (3, 4, 24)
    assert torch.allclose(out.reshape(12, 24), expected, atol=1e-4)
    assert torch.equal(quantize(torch.zeros(3), dtype, False)[0].float(), torch.zeros(3))


def test_int8_weights_are_per_channel() -> None:
    q = int8_dynamic(_gemm())
    assert q.weight().qscheme() == torch.per_channel_affine
    assert q.weight().q_per_channel_scales().shape == (24,)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.c2 = nn.Conv2d(8, 8, 3)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c2(self.c1(x)).flatten(2).transpose(1, 2)
        return self.fc(self.mha(h, h, h, need_weights=False)[0])


def test_variant_that_leaves_most_gemms_alone_is_refused_with_the_names() -> None:
    model, x = ConvNet().eval(), (torch.randn(1, 3, 8, 8),)
    with pytest.raises(VariantCoverageError) as e:
        apply_variant(model, x, "int8", "cpu")
    msg = str(e.value)
    assert "int8 replaced 1 of 5 GEMM-like modules" in msg and "--allow-partial" in msg
    assert "c1 (Conv2d): convolution" in msg and "mha.out_proj" in msg and "in_proj_weight" in msg
    q, _, notes = apply_variant(ConvNet().eval(), x, "int8", "cpu", allow_partial=True)
    left = {x["name"]: x["type"] for x in notes["variant_coverage"]["left_alone"]}
    assert left == {"c1": "Conv2d", "c2": "Conv2d", "mha": "MultiheadAttention",
                    "mha.out_proj": "NonDynamicallyQuantizableLinear"}
    with pytest.raises(VariantCoverageError, match="changes nothing"):
        apply_variant(nn.Sequential(nn.Conv1d(2, 2, 1)), (torch.randn(1, 2, 3),), "fp8-e4m3", "cpu")


def opband(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "opband"), *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_prints_coverage_and_exits_2_on_refusal(tmp_path: Path) -> None:
    r = opband("capture", f"{SPECS}:gpt2", "-o", str(tmp_path / "q.bundle"), "--variant", "int8", "--level", "module")
    assert r.returncode == 0, r.stderr
    assert "int8 replaced 9 of 9 GEMM-like modules (Conv1D 8/8, Linear 1/1)" in r.stdout
    spec = tmp_path / "conv.py"
    spec.write_text("import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Conv1d(2, 2, 1)), "
                    "(torch.randn(1, 2, 3),)\n")
    r = opband("capture", f"{spec}:build", "-o", str(tmp_path / "c.bundle"), "--variant", "w8a16")
    assert r.returncode == 2 and "w8a16 changes nothing" in r.stderr and "Traceback" not in r.stderr
    assert "0 (Conv1d): convolution" in r.stderr
    path = run_capture(f"{spec}:build", tmp_path / "c.bundle", device="cpu", variant="w8a16", allow_partial=True,
                       progress=False)  # what --allow-partial passes
    assert Bundle.open(path).manifest.run["variant_coverage"]["replaced"] == 0


def test_bring_your_own_quantized_model_aligns_by_module(tmp_path: Path) -> None:
    """A SPEC returning a model quantized by another tool (torch.ao QAT fake-quant) is captured as
    is (fp32 variant) and its projections align by module path with the fp32 reference."""
    ref = run_capture(f"{SPECS}:gpt2", tmp_path / "ref.bundle", device="cpu", level="module", progress=False)
    tgt = run_capture(f"{SPECS}:gpt2_qat", tmp_path / "qat.bundle", device="cpu", level="module", progress=False)
    run = Bundle.open(tgt).manifest.run
    assert run["quantized_by_model"] == {"modules": 9, "types": ["Linear"]}
    report = accuracy.compare(ref, tgt)
    paired = {o.module: o for o in report.ops if o.kind == "module" and o.metrics is not None}
    for name in GPT2_GEMMS:
        assert paired[name].aligned_by == "key"
        assert paired[name].metrics.norm_l2 > 1e-4  # type: ignore[union-attr]  # fake-quant error, visible
    extra = {o.module for o in report.ops if o.verdict == "new"}
    assert extra and all("activation_post_process" in m or "fake_quant" in m for m in extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers_specs

        qat, inputs = transformers_specs.gpt2_qat()
    with pytest.raises(VariantCoverageError, match="already quantized"):
        apply_variant(qat, inputs, "int8", "cpu")


def test_w8a16_refuses_what_its_kernel_cannot_run() -> None:
    """torch's CPU ``_weight_int8pack_mm`` segfaults when in_features % 16 != 0: such a module is
    left alone with the reason instead of crashing the capture (the demo decoder's down_proj has 344)."""
    with pytest.raises(ValueError, match="multiple of 16"):
        W8A16Linear(_gemm(in_f=344))
    from hooks import demo_model

    _, _, notes = apply_variant(*demo_model.build(), "w8a16", "cpu")
    left = notes["variant_coverage"]["left_alone"]
    assert {x["name"] for x in left} == {f"model.layers.{i}.mlp.down_proj" for i in range(4)}
    assert all("multiple of 16" in x["reason"] for x in left)


@pytest.mark.parametrize("cls", [W8A16Linear, W4A16Linear])
def test_weight_only_kernels_take_non_contiguous_inputs(cls: type) -> None:
    """BERT feeds its attention output (a permuted view) to a projection: the CPU kernels refuse a
    non-contiguous A, so the replacement makes it dense first."""
    m = cls(_gemm(out_f=32, in_f=64), act_dtype=torch.float32)
    x = torch.randn(4, 64, 3, generator=torch.Generator().manual_seed(8)).transpose(1, 2)
    assert not x.is_contiguous()
    assert torch.equal(m(x), m(x.contiguous()))


def test_bert_every_variant_runs() -> None:
    import transformers_specs

    for variant in QUANTIZED:
        torch.manual_seed(0)
        model, inputs = transformers_specs.bert()
        q, q_inputs, notes = apply_variant(model, inputs, variant, "cpu")
        assert notes["variant_coverage"]["replaced"] == 13
        with torch.no_grad():
            assert torch.isfinite(q(**q_inputs).last_hidden_state).all()
