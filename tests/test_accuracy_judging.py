"""The judging rules the zoo exposed, on hand-made bundles: precision traps, auxiliary outputs,
near-zero outputs, values beyond a target's range, fingerprints of inputs and parameters."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import accuracy
from accuracy import report
from accuracy.budgets import auxiliary_output, default_budget, judged_dtype, precision_trap
from accuracy.bundle import BundleWriter
from accuracy.errors import OpbandError
from accuracy.fingerprints import input_difference, parameter_differences, print_difference
from accuracy.manifest import Fingerprints, Manifest, Record, Stats, TensorPrint


def _bundle(path: Path, arrays: list[tuple[str, str, int, np.ndarray, str]], variant: str = "fp32",
            fingerprints: Fingerprints | None = None) -> Path:
    """Records (key, op, output, values, dtype name) of one module ``m`` (values stored as float32)."""
    w = BundleWriter(path)
    recs = []
    for i, (key, op, out, arr, dtype) in enumerate(arrays):
        name = f"{key}:{out}"
        _store(w, name, arr, dtype)
        recs.append(Record(key=key, output=out, module=key.split("/")[0], op=op, index=i, shape=list(arr.shape),
                           dtype=dtype, tensor=name, input_shapes=[list(arr.shape)],
                           stats=Stats(numel=arr.size, absmax=float(np.abs(arr).max()))))
    return w.close(Manifest(run={"variant": variant}, records=recs, fingerprints=fingerprints))


def _store(w: BundleWriter, name: str, arr: np.ndarray, dtype: str) -> None:
    if dtype == "float16":
        w.add_array(name, arr.astype(np.float16))
    elif dtype == "bfloat16":  # round to nearest even into the upper 16 bits
        bits = arr.astype(np.float32).view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        w.add(name, "BF16", tuple(arr.shape), np.ascontiguousarray(bits).data)
    else:
        w.add_array(name, arr.astype(np.float32))


def test_precision_trap_rule_by_hand() -> None:
    assert precision_trap("float32", "bfloat16", "fp32") == "computed in bfloat16, reference float32, run declared fp32"
    assert precision_trap("float32", "bfloat16", "bf16") is None  # an honest bf16 port
    assert precision_trap("float32", "float32", "bf16") is None  # an upcast op in a bf16 run
    assert precision_trap("float32", "bfloat16", "fp16") is not None  # bf16 (u = 2^-8) is below fp16 (2^-11)
    assert judged_dtype("float32", "bfloat16", "fp32", "propagated") == "float32"
    assert judged_dtype("float32", "bfloat16", "bf16", "propagated") == "bfloat16"


def test_an_op_computed_in_bf16_inside_an_fp32_run_is_the_first_divergence(tmp_path: Path) -> None:
    """Judged at its own dtype the bf16 GEMM (error ~2e-3) would pass its bf16 budget and the next op
    would take the blame; judged at the declared fp32 it fails, with the trap named."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(4096)
    y = x + 1.0
    low = x * (1 + 2e-3 * rng.standard_normal(4096))
    ref = _bundle(tmp_path / "r.bundle", [("lin/aten.mm#0", "aten.mm", 0, x, "float32"),
                                          ("blk/aten.add#0", "aten.add", 0, y, "float32")])
    tgt = _bundle(tmp_path / "t.bundle", [("lin/aten.mm#0", "aten.mm", 0, low, "bfloat16"),
                                          ("blk/aten.add#0", "aten.add", 0, low + 1.0, "float32")])
    rep = accuracy.compare(ref, tgt)
    fd = rep.first_divergence
    assert fd is not None and fd.key == "lin/aten.mm#0" and fd.verdict == "fail"
    assert fd.budget is not None and fd.budget.norm_l2 == default_budget("aten.mm", "aten", "float32").norm_l2
    assert fd.finding == "computed in bfloat16, reference float32, run declared fp32"
    assert "FINDING | computed in bfloat16, reference float32, run declared fp32" in report.headline(rep)
    assert report.to_dict(rep)["first_divergence"]["finding"] == fd.finding


def test_auxiliary_outputs_are_reported_but_never_fail_alone(tmp_path: Path) -> None:
    assert auxiliary_output("aten.native_layer_norm", 1) == "saved mean"
    assert auxiliary_output("aten.max_pool2d_with_indices", 1) == "indices"
    assert auxiliary_output("aten.native_layer_norm", 0) is None and auxiliary_output("aten.var_mean", 1) is None
    rng = np.random.default_rng(1)
    y = rng.standard_normal(256)
    mean = 1e-4 * rng.standard_normal(8)  # ~0 by construction: normalized error explodes
    ref = _bundle(tmp_path / "r.bundle", [("ln/aten.native_layer_norm#0", "aten.native_layer_norm", 0, y, "float32"),
                                          ("ln/aten.native_layer_norm#0", "aten.native_layer_norm", 1, mean, "float32")])
    tgt = _bundle(tmp_path / "t.bundle", [("ln/aten.native_layer_norm#0", "aten.native_layer_norm", 0, y, "bfloat16"),
                                          ("ln/aten.native_layer_norm#0", "aten.native_layer_norm", 1, mean + 1e-3,
                                           "bfloat16")], variant="bf16")
    rep = accuracy.compare(ref, tgt)
    aux = next(o for o in rep.ops if o.output == 1)
    assert rep.verdict == "pass" and rep.first_divergence is None
    assert aux.auxiliary == "saved mean" and aux.error > 1.0
    assert aux.reason.startswith("auxiliary output (saved mean), reported, not judged alone: norm L2 err")


def test_values_below_the_dtypes_normal_range_are_judged_against_an_absolute_floor(tmp_path: Path) -> None:
    """A layer scale of 1e-6 times activations of 1e-2 in fp16: every value underflows to 0 (normalized
    error 1.0), but the RMS error (~1e-8) is below fp16's absolute floor 4 * 2^-14 * 2^-11 = 1.2e-7."""
    small = 1e-8 * np.random.default_rng(2).standard_normal(512)
    ref = _bundle(tmp_path / "r.bundle", [("blk/aten.mul#0", "aten.mul", 0, small, "float32")])
    tgt = _bundle(tmp_path / "t.bundle", [("blk/aten.mul#0", "aten.mul", 0, np.zeros(512), "float16")], "fp16")
    op = accuracy.compare(ref, tgt).ops[0]
    assert default_budget("aten.mul", "aten", "float16").atol == pytest.approx(4 * 2.0**-14 * 2.0**-11)
    assert op.verdict == "pass" and op.error == pytest.approx(1.0) and "absolute floor 1.2e-07" in op.reason
    # the same pattern at 1e-4 (above the floor) is a real loss
    tgt = _bundle(tmp_path / "t2.bundle", [("blk/aten.mul#0", "aten.mul", 0, np.zeros(512), "float16")], "fp16")
    ref = _bundle(tmp_path / "r2.bundle", [("blk/aten.mul#0", "aten.mul", 0, small * 1e4, "float32")])
    assert accuracy.compare(ref, tgt).ops[0].verdict == "fail"


def test_reference_values_beyond_the_targets_range_are_compared_clipped(tmp_path: Path) -> None:
    """finfo(float32).min as a mask value is finfo(float16).min in an honest fp16 port."""
    ref = _bundle(tmp_path / "r.bundle", [("att/aten.where#0", "aten.where", 0, np.array([1.0, -3.4028235e38]),
                                           "float32")])
    tgt = _bundle(tmp_path / "t.bundle", [("att/aten.where#0", "aten.where", 0, np.array([1.0, -65504.0]),
                                           "float16")], "fp16")
    op = accuracy.compare(ref, tgt).ops[0]
    assert op.verdict == "pass" and op.error == 0.0


def _print(values: np.ndarray, dtype: str = "float32", digest: str | None = None) -> TensorPrint:
    v = values.astype(np.float64)
    return TensorPrint(shape=list(values.shape), dtype=dtype, digest=digest or str(hash(values.tobytes())),
                       sum=float(v.sum()), l2=float(np.linalg.norm(v)), absmax=float(np.abs(v).max()))


def test_print_difference_is_bitwise_within_a_dtype_and_rounding_aware_across_a_cast() -> None:
    w = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32) * 0.02
    assert print_difference(_print(w), _print(w)) is None
    bad = w.copy()
    bad[5, 7] += 0.5
    assert print_difference(_print(w), _print(bad)).startswith("sum ")  # type: ignore[union-attr]
    # an honest bf16 cast (round to 8 bits of mantissa) is not a difference; the corrupted one is
    bf16 = (w.view(np.uint32) + 0x8000 & 0xFFFF0000).view(np.float32)
    assert print_difference(_print(w), _print(bf16, "bfloat16")) is None
    bad16 = (bad.view(np.uint32) + 0x8000 & 0xFFFF0000).view(np.float32)
    assert print_difference(_print(w), _print(bad16, "bfloat16")) is not None
    assert print_difference(_print(w), _print(w[:32])) == "shape 64x64 vs 32x64"


def _on_device(p: TensorPrint, **changes: float) -> TensorPrint:
    """``p`` as an accelerator run prints it: no digest (and ``changes`` to its statistics)."""
    return p.model_copy(update={"digest": "", **changes})


def test_prints_without_a_digest_allow_summation_order_by_dtype() -> None:
    """An accelerator print (no digest) against a CPU one: float32 sums may differ in the last digits;
    float64 and integer ones only by float64 rounding (two token ids changed in 4096, or one by 1 in 1M,
    is a different input); identical prints match even when their L2 overflowed to inf."""
    ids = np.arange(4096).reshape(8, 512) % 1000
    moved = ids.copy()
    moved[0, 3] += 7
    moved[5, 9] -= 3
    assert print_difference(_print(ids, "int64"), _on_device(_print(moved, "int64"))) is not None
    assert print_difference(_print(ids, "int64"), _on_device(_print(ids, "int64"))) is None
    many = np.random.default_rng(6).integers(0, 150_000, 1 << 20)  # sum of squares past 2^53: rounds by order
    one_off = many.copy()
    one_off[12345] += 1
    p = _print(many, "int64")
    assert print_difference(p, _on_device(p, l2=p.l2 * (1 + 2e-16))) is None
    assert print_difference(p, _on_device(_print(one_off, "int64"))) is not None
    w = np.random.default_rng(5).standard_normal((256, 256))
    scaled = w.copy()
    scaled[7] *= 1.0001
    f64 = _print(w, "float64")
    assert print_difference(f64, _on_device(f64, sum=f64.sum + 1e-13, l2=f64.l2 * (1 + 1e-14))) is None
    assert print_difference(f64, _on_device(_print(scaled, "float64"))) is not None
    f32 = _print(w.astype(np.float32))
    assert print_difference(f32, _on_device(f32, sum=f32.sum + 1e-6, l2=f32.l2 * (1 - 1e-7))) is None
    assert print_difference(f32, _on_device(f32, l2=f32.l2 * (1 - 1e-5))) is not None
    with np.errstate(over="ignore"):
        huge = _print(np.array([1e200, -1e200, 3.0]), "float64")
    assert huge.l2 == float("inf") and print_difference(huge, _on_device(huge)) is None


def test_different_inputs_stop_compare_with_a_sentence(tmp_path: Path) -> None:
    ids12, ids16 = np.arange(24).reshape(2, 12), np.arange(32).reshape(2, 16)
    a = Fingerprints(inputs={"input_ids": _print(ids12, "int64")})
    b = Fingerprints(inputs={"input_ids": _print(ids16, "int64")})
    assert input_difference(a, b) == "input_ids shape 2x12 vs 2x16"
    assert input_difference(a, Fingerprints(inputs={})) is None  # no fingerprints: nothing to say
    x = np.ones(8)
    ref = _bundle(tmp_path / "r.bundle", [("m/aten.add#0", "aten.add", 0, x, "float32")], fingerprints=a)
    tgt = _bundle(tmp_path / "t.bundle", [("m/aten.add#0", "aten.add", 0, x, "float32")], fingerprints=b)
    with pytest.raises(OpbandError, match=r"^the two runs had different inputs: input_ids shape 2x12 vs 2x16\. "):
        accuracy.compare(ref, tgt)


def test_different_parameters_are_a_finding_and_name_the_module(tmp_path: Path) -> None:
    w = np.random.default_rng(4).standard_normal(16)
    bad = w.copy()
    bad[3] = 9.0
    ref_fp = Fingerprints(parameters={"a.weight": _print(w, digest="1"), "b.weight": _print(w, digest="1")})
    tgt_fp = Fingerprints(parameters={"a.weight": _print(w, digest="1"), "b.weight": _print(bad, digest="2")})
    diffs, note = parameter_differences(ref_fp, tgt_fp, "fp32")
    assert note is None and [(d.name, d.module) for d in diffs] == [("b.weight", "b")]
    assert diffs[0].sentence.startswith("weight of `b` differs: sum ")
    for quantized in ("int8", "w8a16", "w4a16", "fp8-e4m3", "fp8-e5m2-rowwise"):  # weights changed by design
        none, why = parameter_differences(ref_fp, tgt_fp, quantized)
        assert none == [] and why is not None and quantized in why
    x = np.ones(8)
    recs = [("a/aten.mul#0", "aten.mul", 0, x, "float32"), ("b/aten.mul#0", "aten.mul", 0, x, "float32")]
    rep = accuracy.compare(_bundle(tmp_path / "r.bundle", recs, fingerprints=ref_fp),
                           _bundle(tmp_path / "t.bundle", recs, fingerprints=tgt_fp))
    fd = rep.first_divergence
    assert rep.verdict == "fail" and fd is not None and fd.module == "b" and "weight of `b` differs" in str(fd.finding)


def test_unrelated_models_are_refused(tmp_path: Path) -> None:
    def modules(path: Path, names: list[str]) -> Path:
        w = BundleWriter(path)
        recs = []
        for i, n in enumerate(names):
            w.add_array(n, np.ones(4, np.float32))
            recs.append(Record(key=f"{n}/forward#0", module=n, op="forward", kind="module", index=i, shape=[4],
                               dtype="float32", tensor=n))
        return w.close(Manifest(run={"variant": "fp32"}, records=recs))

    ref = modules(tmp_path / "r.bundle", ["embed", "layers.0", "layers.1", "norm"])
    tgt = modules(tmp_path / "t.bundle", ["encoder.layer.0", "encoder.layer.1", "pooler", "norm"])
    with pytest.raises(OpbandError, match=r"not the same model: only 1 of the reference's 4 modules exist"):
        accuracy.compare(ref, tgt)
