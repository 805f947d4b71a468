"""`opband sweep`: ops x shapes x dtypes x value regimes without a model, as ordinary bundles."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F  # noqa: N812

import accuracy
from accuracy.bundle import Bundle
from hooks.opcases import BUILTIN, CaseError, make_inputs, parse_shapes, regime_values, resolve_case
from hooks.opsweep import OpSpec, SweepConfig, load_sweep_file, make_config, plan, run_sweep

OPBAND = str(Path(sys.executable).with_name("opband"))


def _ftz_silu(real):  # noqa: ANN001, ANN202
    """An injected kernel bug: the bf16 SiLU flushes |x| < 1e-3 to zero (an FTZ fast path)."""
    def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            x = torch.where(x.abs() < 1e-3, torch.zeros_like(x), x)
        return real(x)
    return silu


def test_injected_fault_is_found_with_its_shape_and_regime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SweepConfig(ops=[OpSpec("silu", ["4x64x96"]), OpSpec("mm"), OpSpec("softmax")], dtypes=["bf16", "fp16"],
                      regimes=["normal", "large", "near_zero"])
    honest = run_sweep(cfg, tmp_path / "honest", progress=False).report
    assert len(honest.rows) == 3 * 2 * 3
    assert {r.verdict for r in honest.rows if r.dtype == "bf16"} == {"pass"}, honest.to_text()

    monkeypatch.setattr(F, "silu", _ftz_silu(F.silu))
    faulty = run_sweep(cfg, tmp_path / "faulty", progress=False).report
    before = {(r.op, r.dtype, r.shape, r.regime) for r in honest.rows if r.verdict != "pass"}
    failed = {(r.op, r.dtype, r.shape, r.regime) for r in faulty.rows if r.verdict != "pass"}
    assert failed - before == {("silu", "bf16", "4x64x96", "near_zero")}, faulty.to_text()
    line = next(line for line in faulty.failure_lines() if line.startswith("FAILED | silu"))
    assert line.startswith("FAILED | silu bf16 shape 4x64x96 regime near_zero (op aten.silu, key "
                           "sweep.silu.near_zero.4x64x96/aten.silu#0) | norm L2 err 1.0e+00 > budget 3.1e-02")
    assert "PASSED" not in faulty.to_text().splitlines()[-1]


def test_sweep_bundles_are_ordinary_bundles(tmp_path: Path) -> None:
    cfg = SweepConfig(ops=[OpSpec("topk"), OpSpec("embedding"), OpSpec("rope")], dtypes=["bf16", "int8"],
                      regimes=["normal", "nonfinite"])
    result = run_sweep(cfg, tmp_path, progress=False)
    ref = Bundle.open(result.reference)
    cases = ref.manifest.run["sweep"]["cases"]
    assert set(cases) == {r.key for r in ref.records}
    key = "sweep.embedding.normal.512x128_2x32/aten.embedding#0"
    assert cases[key] == {"op": "embedding", "label": "embedding", "kwargs": None, "regime": "normal",
                          "shape": "512x128,2x32", "seed": cases[key]["seed"]}
    rec = ref.record(key)
    assert rec.input_shapes == [[512, 128], [2, 32]] and rec.input_dtypes == ["float32", "int64"]
    weight, ids = (ref.values(n) for n in rec.input_tensors)
    assert (ref.record_values(key) == weight[ids]).all(), "the stored output is the stored inputs' embedding"
    assert ref.record("sweep.topk.normal.16x512/aten.topk#0").shape == [16, 8], "topk keeps its values, not indices"
    for variant, path in result.targets.items():
        tgt = Bundle.open(path)
        assert tgt.manifest.run["replay_of"] == str(result.reference) and tgt.manifest.variant == variant
        report = accuracy.compare(result.reference, path, mode="replay")  # the existing pipeline, unchanged
        assert {o.key for o in report.ops} == set(cases) and not report.unmatched
    rows = {(r.op, r.dtype, r.regime): r for r in result.report.rows}
    assert rows[("embedding", "bf16", "normal")].norm_l2 == 0, "exact inputs: a bf16 gather is exact"
    assert rows[("rope", "bf16", "normal")].verdict == "pass"
    # int8 fake quantization maps +-inf to the largest finite level: a real NaN/Inf mismatch
    assert rows[("embedding", "int8", "nonfinite")].verdict == "fail"
    assert "Inf mismatches" in rows[("embedding", "int8", "nonfinite")].reason
    data = json.loads(result.report.to_json())
    assert data["schema"] == "opband.sweep/1" and len(data["rows"]) == 3 * 2 * 2


def test_fp8_targets_carry_their_rounding(tmp_path: Path) -> None:
    cfg = SweepConfig(ops=[OpSpec("mm")], dtypes=["fp8-e4m3", "fp8-e5m2"], regimes=["normal"])
    rows = {r.dtype: r for r in run_sweep(cfg, tmp_path, progress=False).report.rows}
    # inputs rounded to 3 (e4m3) or 2 (e5m2) mantissa bits: a few percent, the e5m2 error about twice e4m3's
    assert 0.01 < rows["fp8-e4m3"].norm_l2 < 0.06 and 1.5 < rows["fp8-e5m2"].norm_l2 / rows["fp8-e4m3"].norm_l2 < 2.5
    assert {r.verdict for r in rows.values()} == {"pass"}


def test_regimes_hold_what_they_promise() -> None:
    gen = torch.Generator().manual_seed(0)
    sub = regime_values("subnormal", [4096], gen)
    tiny = torch.finfo(torch.float32).tiny
    assert ((sub.abs() < tiny) & (sub != 0)).float().mean() > 0.99
    nf = regime_values("nonfinite", [1000], gen)
    assert int(torch.isnan(nf).sum()) == 6 and int((nf == math.inf).sum()) == 7 == int((nf == -math.inf).sum())  # 20 picks
    ill = regime_values("ill_conditioned", [4096], gen)
    assert ill.abs().min() > 990 and abs(float(ill.double().sum())) < 0.1 * float(ill.abs().sum())
    big = regime_values("large", [4096], gen)
    assert 5e3 < float(big.std()) < 2e4
    with pytest.raises(CaseError, match="choose from"):
        regime_values("weird", [2], gen)


def test_exact_inputs_make_the_target_cast_lossless_where_the_dtype_can() -> None:
    case = BUILTIN["mm"]
    for regime in ("normal", "large", "near_zero", "ill_conditioned"):
        a, b = make_inputs(case, parse_shapes(case.shapes[0]), regime, 3, [torch.float16, torch.bfloat16])
        for t in (a, b):
            assert torch.equal(t.to(torch.bfloat16).float(), t), regime
            if regime != "large" and regime != "near_zero":  # fp16 overflows 1e4 products, flushes tiny values
                assert torch.equal(t.to(torch.float16).float(), t), regime
    ids = make_inputs(BUILTIN["embedding"], [[10, 4], [3, 5]], "normal", 0)[1]
    assert ids.dtype == torch.int64 and int(ids.max()) < 10


def test_ops_by_name_files_and_bad_input(tmp_path: Path) -> None:
    assert resolve_case("aten._softmax") is BUILTIN["softmax"]
    alone, among = plan(SweepConfig(ops=[OpSpec("mm")]))[0], plan(SweepConfig(ops=[OpSpec("silu"), OpSpec("mm")]))[0]
    assert {p.key: p.seed for p in alone}.items() <= {p.key: p.seed for p in among}.items(), "inputs follow the key"
    erf = resolve_case("torch.special.erf")
    assert erf.kind == "api" and erf.op == "torch.special.erf"
    with pytest.raises(CaseError, match="unknown op 'aten.no_such_op'"):
        resolve_case("aten.no_such_op")
    with pytest.raises(CaseError, match="joined by 'x'"):
        parse_shapes("64 by 64")
    f = tmp_path / "sweep.toml"
    f.write_text('dtypes = ["fp16"]\nregimes = ["normal", "large"]\n'
                 '[[ops]]\nname = "torch.special.erf"\nshapes = ["8x64"]\n'
                 '[[ops]]\nname = "aten.gelu"\nshapes = ["8x64"]\nkwargs = {approximate = "tanh"}\nlabel = "gelu_tanh8"\n')
    cfg = load_sweep_file(f)
    assert cfg.dtypes == ["fp16"] and cfg.ops[1].kwargs == {"approximate": "tanh"}
    report = run_sweep(cfg, tmp_path / "out", progress=False).report
    assert {(r.op, r.regime, r.verdict) for r in report.rows} == {
        ("torch_special_erf", "normal", "pass"), ("torch_special_erf", "large", "pass"),
        ("gelu_tanh8", "normal", "pass"), ("gelu_tanh8", "large", "pass")}
    (tmp_path / "bad.yaml").write_text("dtype: [bf16]\n")
    with pytest.raises(CaseError, match=r"unknown key\(s\) \['dtype'\]"):
        load_sweep_file(tmp_path / "bad.yaml")
    with pytest.raises(CaseError, match="choose from"):
        make_config(dtypes=["fp12"])
    for text, message in (('dtypes = "bf16"\n', "dtypes: Input should be a valid list"),
                          ('[[ops]]\nname = "mm"\nshapes = [64]\n', "ops.0.shapes.0: Input should be a valid string"),
                          ('seed = "x"\n', "seed: Input should be a valid integer"),
                          ('[[ops]]\nname = "mm"\ncall = {target = "aten.mm.default"}\n', r"unknown field\(s\) \['call'\]"),
                          ("dtypes = [\n", "is not valid TOML")):
        f.write_text(text)
        with pytest.raises(CaseError, match=message):
            load_sweep_file(f)


def test_from_bundle_sweeps_the_models_ops_at_recorded_shapes(tmp_path: Path) -> None:
    from hooks import capture
    from hooks.demo_model import DecoderConfig, build

    model, (ids,) = build(DecoderConfig(layers=1, dim=32, heads=2, hidden=48, seq=8, vocab=64))
    with torch.no_grad(), capture(model, tmp_path / "model.bundle", progress=False):
        model(ids)
    cfg = SweepConfig(from_bundle=str(tmp_path / "model.bundle"), dtypes=["bf16"], regimes=["normal"])
    report = run_sweep(cfg, tmp_path / "out", progress=False).report
    ops = {r.op: r for r in report.rows}
    assert ops["mm"].shape in ("16x32,32x32", "16x32,32x48", "16x48,48x32", "16x32,32x64")
    assert "embedding" in ops and ops["embedding"].shape == "64x32,2x8"
    assert {r.verdict for r in report.rows} == {"pass"}, report.to_text()
    assert any("aten." in s for s in report.skipped), "ops needing non-tensor arguments are listed as skipped"

    # captured with --inputs, each call was recorded: replayed as it was (overload, scalars) on new tensors
    with torch.no_grad(), capture(model, tmp_path / "calls.bundle", progress=False, inputs=True):
        model(ids)
    cfg = SweepConfig(from_bundle=str(tmp_path / "calls.bundle"), dtypes=["bf16"], regimes=["normal", "large"])
    result = run_sweep(cfg, tmp_path / "calls", progress=False)
    rows = {(r.op, r.shape, r.regime): r for r in result.report.rows}
    assert not result.report.skipped and {r.verdict for r in rows.values()} == {"pass"}
    assert ("aten_div_Tensor", "2x2x8x8", "large") in rows and ("aten_masked_fill_Scalar", "2x2x8x8,8x8", "normal") in rows
    ref = Bundle.open(result.reference)
    key = rows[("aten_div_Tensor", "2x2x8x8", "large")].key
    call = ref.manifest.run["sweep"]["cases"][key]["call"]
    assert call["target"] == "aten.div.Tensor" and call["args"][1] == 4.0, "the scores' scale 1/sqrt(head dim 16)"
    x = ref.values(ref.record(key).input_tensors[0])
    assert (ref.record_values(key) == x / 4.0).all()


def test_cli_sweep(tmp_path: Path) -> None:
    r = subprocess.run([OPBAND, "sweep", "--op", "rsqrt", "--op", "sum", "--dtype", "bf16", "--regime", "normal",
                        "--regime", "subnormal", "-o", str(tmp_path / "s"), "--json", str(tmp_path / "s.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "opband sweep: bf16 vs fp32 reference" in r.stdout
    # CPU's bf16 rsqrt treats subnormal inputs as zero (1/sqrt(0) = inf) where fp32 gives ~1e20: a kernel finding
    assert "FAILED | rsqrt bf16 shape 2x32x256 regime subnormal" in r.stdout and "Inf mismatches" in r.stdout
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert len(rows) == 4 and {(x["op"], x["regime"]) for x in rows if x["verdict"] == "pass"} >= {
        ("rsqrt", "normal"), ("sum", "normal")}
    (tmp_path / "ops.txt").write_text("# what the target's library implements\naten.rsqrt\n")
    again = subprocess.run([OPBAND, "sweep", "--op-list", str(tmp_path / "ops.txt"), "--dtype", "bf16", "--regime",
                            "subnormal", "--check", "-o", str(tmp_path / "t")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "FAILED | rsqrt bf16 shape 2x32x256 regime subnormal" in again.stdout
    # the targets alone, later or elsewhere, on the inputs the reference stored
    later = subprocess.run([OPBAND, "sweep", "--reference", str(tmp_path / "s/reference.bundle"), "--dtype", "fp16",
                            "-o", str(tmp_path / "later")], capture_output=True, text=True, timeout=300)
    assert later.returncode == 0 and "opband sweep: fp16 vs fp32 reference" in later.stdout, later.stderr
    assert sorted(p.name for p in (tmp_path / "later").iterdir()) == ["fp16.bundle"]
    assert Bundle.open(tmp_path / "later/fp16.bundle").manifest.run["replay_of"] == str(tmp_path / "s/reference.bundle")
    bad = subprocess.run([OPBAND, "sweep", "--op", "nope", "-o", str(tmp_path / "u")], capture_output=True, text=True)
    assert bad.returncode == 2 and "error: nothing to sweep: nope: unknown op" in bad.stderr
    cmp = subprocess.run([OPBAND, "compare", str(tmp_path / "s/reference.bundle"), str(tmp_path / "s/bf16.bundle"),
                          "--mode", "replay"], capture_output=True, text=True, timeout=300)
    assert cmp.returncode == 1 and "each op ran on the reference's inputs" in cmp.stdout


@pytest.mark.sweep
def test_full_llm_list_three_dtypes_every_regime_finds_the_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = SweepConfig(dtypes=["bf16", "fp16", "int8"])
    honest = run_sweep(cfg, tmp_path / "honest", progress=False).report
    assert len(honest.rows) == len(BUILTIN) * 3 * 6 and not honest.skipped
    monkeypatch.setattr(F, "silu", _ftz_silu(F.silu))
    faulty = run_sweep(cfg, tmp_path / "faulty", progress=False).report
    bad = lambda rep: {(r.op, r.dtype, r.shape, r.regime) for r in rep.rows if r.verdict != "pass"}  # noqa: E731
    assert bad(faulty) - bad(honest) == {("silu", "bf16", "2x32x344", "near_zero")}
