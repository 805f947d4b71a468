"""Small pairs measured together (``metrics.PairBatch``, ``compare``'s measure-ahead) give each pair exactly
the numbers it gets measured alone: on hand-built buffers at unaligned offsets, on bundles built to hit every
branch of the judge, and on a real capture of the demo decoder in fp32 against bf16."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from importlib import import_module
from typing import Any

import numpy as np
import pytest

from accuracy import metrics as M
from accuracy.bundle import Bundle, BundleWriter
from accuracy.compare import compare
from accuracy.manifest import Manifest, Record, Stats

_RNG = np.random.default_rng(11)
compare_module = import_module("accuracy.compare")  # the module, not the function the package exports


def _bf16_words(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _stored(x: np.ndarray, tag: str) -> np.ndarray:
    """``x`` in the stored form of ``tag`` (the array compare_arrays is given: BF16 as words)."""
    return {"F32": lambda: x.astype(np.float32), "F64": lambda: x.astype(np.float64),
            "F16": lambda: x.astype(np.float16), "BF16": lambda: _bf16_words(x)}[tag]()


def _case(n: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    r = _RNG.standard_normal(n) * 10.0 ** _RNG.integers(-3, 4)
    t = r * (1 + _RNG.standard_normal(n) * 1e-3)
    if kind == "non-finite" and n >= 8:
        t[[1, 5]] = np.nan
        r[[2, 5]] = np.inf
        t[7] = -np.inf
    elif kind == "equal":
        t = r.copy()
    elif kind == "zeros":
        r[:] = 0.0
    return r, t


@pytest.mark.parametrize("layout", ["aligned", "unaligned"])
@pytest.mark.parametrize("ref_tag,tgt_tag,target_dtype", [
    ("F32", "BF16", "bfloat16"), ("F32", "F16", "float16"), ("F32", "F32", "float32"), ("F64", "F32", "float32"),
    ("F64", "F64", "float64"), ("BF16", "BF16", "bfloat16"), ("F16", "F32", "float32"), ("F32", "F32", "float8_e4m3fn"),
    ("F32", "F32", "int8"),
])
def test_a_batch_gives_each_pair_what_compare_arrays_gives_it(ref_tag: str, tgt_tag: str, target_dtype: str,
                                                              layout: str) -> None:
    """Pairs of sizes 0 to 5000 elements (across the kernel's 512-element blocks), with and without a known
    reference absmax, with NaN/Inf, equal values and zero references, read where they lie (aligned) or
    copied (at odd byte offsets; at most PACK_MAX elements): every field of every Metrics equals the pair
    measured alone."""
    pad = 8 if layout == "aligned" else 1
    ref_buf, tgt_buf = bytearray(b"\x01" * pad), bytearray(b"\x02\x03\x04" if pad == 1 else b"\x02" * 16)
    sizes = [(0, "plain"), (1, "plain"), (3, "equal"), (64, "plain"), (64, "non-finite"), (511, "zeros"),
             (513, "plain"), (M.PACK_MAX if pad == 1 else 5000, "non-finite"), (700, "equal")]
    queued: list[tuple[int, int, int, int, float | None]] = []
    expected: list[M.Metrics] = []
    for i, (n, kind) in enumerate(sizes):
        r, t = _case(n, kind)
        rs, ts = _stored(r, ref_tag), _stored(t, tgt_tag)
        absmax = float(np.max(np.abs(r[np.isfinite(r)]))) if i % 2 and n else None
        expected.append(M.compare_arrays(rs, ts, target_dtype, absmax, reference_dtype=ref_tag if ref_tag == "BF16" else None,
                                         stored_dtype=tgt_tag if tgt_tag == "BF16" else None))
        queued.append((len(ref_buf), rs.nbytes, len(tgt_buf), ts.nbytes, absmax))
        ref_buf += rs.tobytes() + b"\x05" * (i % 3 if pad == 1 else -rs.nbytes % 8)
        tgt_buf += ts.tobytes() + b"\x06" * (i % 5 if pad == 1 else -ts.nbytes % 8 + 8)
    # buffers at 8-byte aligned addresses, as a mapped file's
    ref_arr = np.zeros((len(ref_buf) + 7) // 8, np.uint64).view(np.uint8)[: len(ref_buf)]
    tgt_arr = np.zeros((len(tgt_buf) + 7) // 8, np.uint64).view(np.uint8)[: len(tgt_buf)]
    ref_arr[:], tgt_arr[:] = np.frombuffer(bytes(ref_buf), np.uint8), np.frombuffer(bytes(tgt_buf), np.uint8)
    ref_arr.flags.writeable = tgt_arr.flags.writeable = False  # as a mapped bundle's
    batch = M.PairBatch(ref_arr, tgt_arr)
    for ra, rb, ta, tb, absmax in queued:
        assert batch.add((ra, rb, ref_tag), (ta, tb, tgt_tag), target_dtype, absmax)
    assert len(batch) == len(queued)
    got = batch.measure()
    assert [m.as_dict() for m in got] == [m.as_dict() for m in expected]
    assert got[3].numel == 64 and got[0].numel == 0 and got[4].nan_mismatch >= 1


def test_a_batch_refuses_what_it_cannot_read_undecoded() -> None:
    buf = np.zeros(1 << 20, np.uint8)
    batch = M.PairBatch(buf, buf)
    assert not batch.add((0, 64, "F8_E4M3"), (0, 256, "F32"), "float32", None)  # FP8 is decoded first
    assert not batch.add((0, 256, "F32"), (0, 256, "I32"), "float32", None)
    assert not batch.add((0, 256, "F32"), (0, 64, "BF16"), "bfloat16", None)  # 64 against 32 elements
    assert not batch.add((0, 6, "F32"), (0, 3, "BF16"), "bfloat16", None)  # not whole elements
    big = (M.BATCH_MAX + 1) * 4
    assert not batch.add((0, big, "F32"), (0, big, "F32"), "float32", None)
    copied = (M.PACK_MAX + 1) * 4  # unaligned values are copied: at most PACK_MAX elements
    assert not batch.add((2, copied, "F32"), (0, copied, "F32"), "float32", None)
    assert len(batch) == 0 and batch.measure() == []
    assert batch.add((0, M.BATCH_MAX * 4, "F32"), (0, M.BATCH_MAX * 2, "BF16"), "bfloat16", None)
    assert batch.add((2, M.PACK_MAX * 4, "F32"), (0, M.PACK_MAX * 4, "F32"), "float32", None)


def _record(i: int, name: str | None, shape: list[int], dtype: str, absmax: float | None, op: str = "aten.mul",
            output: int = 0) -> Record:
    return Record(key=f"m{i // 4}/{op}#{i % 4}", output=output, module=f"m{i // 4}", op=op, ordinal=i % 4, index=i,
                  input_shapes=[shape], input_dtypes=["float32"], shape=shape, dtype=dtype, tensor=name,
                  stats=Stats(numel=int(np.prod(shape)), absmax=absmax))


def _branchy_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A reference and a target whose records take every path of the judge: batched float pairs of every
    stored form, a tensor two records share, a clipped compare (reference beyond float16's range), FP8 and
    integer tensors, a shape and a dtype-kind mismatch, statistics-only records, a pair over BATCH_MAX
    elements, an empty tensor, NaN/Inf, and an op output the target lacks."""
    ref_w, tgt_w = BundleWriter(tmp_path / "ref.bundle"), BundleWriter(tmp_path / "tgt.bundle")
    refs: list[Record] = []
    tgts: list[Record] = []

    def pair(name: str, r: np.ndarray, t: np.ndarray | None, tgt_dtype: str, tgt_tag: str, ref_tag: str = "F32",
             op: str = "aten.mul", shape_t: list[int] | None = None, output: int = 0) -> None:
        i = len(refs)
        ref_w.add_array(name, _stored(r, ref_tag)) if ref_tag != "BF16" else ref_w.add(
            name, "BF16", r.shape, _bf16_words(r).data)
        ref_dtype = {"F32": "float32", "F64": "float64", "F16": "float16", "BF16": "bfloat16"}.get(ref_tag, "int32")
        finite = r[np.isfinite(r)]
        absmax = float(np.abs(finite).max()) if finite.size else None
        refs.append(_record(i, name, list(r.shape), ref_dtype, absmax, op, output))
        if t is None:
            return
        if tgt_tag == "BF16":
            tgt_w.add(name, "BF16", t.shape, _bf16_words(t).data)
        elif tgt_tag == "F8_E4M3":
            tgt_w.add(name, "F8_E4M3", t.shape, np.clip(np.round(t), 0, 100).astype(np.uint8).data)
        elif tgt_tag == "I32":
            tgt_w.add_array(name, t.astype(np.int32))
        else:
            tgt_w.add_array(name, _stored(t, tgt_tag))
        tgts.append(_record(i, name, shape_t or list(t.shape), tgt_dtype, None, op, output))

    for k, n in enumerate([1, 7, 64, 100, 512, 513, 2048, 3000]):
        r = _RNG.standard_normal(n).astype(np.float32)
        pair(f"bf{k}", r, r, "bfloat16", "BF16")
        pair(f"h{k}", r, r.astype(np.float16).astype(np.float32), "float16", "F16")
        pair(f"f{k}", r, r * np.float32(1 + 1e-6), "float32", "F32")
        pair(f"d{k}", r.astype(np.float64), r, "float32", "F32", ref_tag="F64")
    r = _RNG.standard_normal(64).astype(np.float32)
    pair("shared", r, r * 1.001, "bfloat16", "BF16")
    refs.append(_record(len(refs), "shared", [64], "float32", float(np.abs(r).max()), op="aten._unsafe_view"))
    tgts.append(_record(len(tgts), "shared", [64], "bfloat16", None, op="aten._unsafe_view"))
    huge = _RNG.standard_normal(64).astype(np.float32) * 1e5  # beyond float16's range: compared clipped
    pair("clip", huge, np.clip(huge, -65504, 65504), "float16", "F16")
    pair("fp8", np.round(_RNG.uniform(0, 50, 32)).astype(np.float32), np.round(_RNG.uniform(0, 50, 32)), "float8_e4m3fn",
         "F8_E4M3")
    ints = _RNG.integers(0, 9, 40)
    ref_w.add_array("ints", ints.astype(np.int32))
    refs.append(_record(len(refs), "ints", [40], "int32", None))
    tgt_w.add_array("ints", (ints + (np.arange(40) == 3)).astype(np.int32))
    tgts.append(_record(len(tgts), "ints", [40], "int32", None))
    pair("reshaped", r, r, "bfloat16", "BF16", shape_t=[8, 8])  # same elements, another shape
    pair("shape", r, r[:32], "bfloat16", "BF16")  # shape differs
    pair("kind", r, r, "int32", "I32")  # float against integers
    big = _RNG.standard_normal(M.BATCH_MAX + 5).astype(np.float32)
    pair("big", big, big, "bfloat16", "BF16")
    pair("empty", np.zeros(0, np.float32), np.zeros(0, np.float32), "bfloat16", "BF16")
    nf = _RNG.standard_normal(600).astype(np.float32)
    nf_t = nf.copy()
    nf[[3, 9]] = np.inf
    nf_t[[4, 9, 500]] = np.nan
    pair("nonfinite", nf, nf_t, "bfloat16", "BF16")
    pair("only-ref", r, None, "bfloat16", "BF16")
    i = len(refs)
    refs.append(Record(key=f"m{i // 4}/aten.add#{i % 4}", module=f"m{i // 4}", op="aten.add", index=i, shape=[8],
                       dtype="float32", stats=Stats(numel=8, mean=0.1, l2=1.0, absmax=0.5)))
    tgts.append(Record(key=f"m{i // 4}/aten.add#{i % 4}", module=f"m{i // 4}", op="aten.add", index=i, shape=[8],
                       dtype="bfloat16", stats=Stats(numel=8, mean=0.12, l2=1.01, absmax=0.52)))
    run = {"variant": "fp32", "device": "cpu"}
    ref_w.close(Manifest(run=run, records=refs))
    tgt_w.close(Manifest(run={**run, "variant": "bf16"}, records=tgts))
    return tmp_path / "ref.bundle", tmp_path / "tgt.bundle"


def _as_rows(report: Any) -> list[dict[str, Any]]:
    rows = []
    for op in report.ops:
        d = asdict(op)
        d["metrics"] = op.metrics.as_dict() if op.metrics else None
        d["reference_metrics"] = op.reference_metrics.as_dict() if op.reference_metrics else None
        rows.append(d)
    return rows


def _one_by_one(monkeypatch: pytest.MonkeyPatch, ref: Path, tgt: Path) -> Any:
    with monkeypatch.context() as m:
        m.setattr(compare_module, "MEASURE_BATCH", 1)  # a batch of one pair is measured alone
        return compare(ref, tgt)


def test_measuring_ahead_changes_no_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, tgt = _branchy_pair(tmp_path)
    seen: list[int] = []
    original_measure = M.PairBatch.measure

    def measure(self: M.PairBatch) -> list[M.Metrics]:
        seen.append(len(self))
        return original_measure(self)

    monkeypatch.setattr(M.PairBatch, "measure", measure)
    batched = compare(ref, tgt)
    monkeypatch.undo()
    alone = _one_by_one(monkeypatch, ref, tgt)
    assert _as_rows(batched) == _as_rows(alone)
    assert sum(seen) >= 33  # the 32 float pairs of every stored form, the shared tensor's first record
    opened = Bundle.open(ref)
    by_tensor = {opened.record(o.id).tensor: o for o in batched.ops if o.aligned_by != "none"}
    unaligned = {opened.record(o.id).tensor for o in batched.ops if o.aligned_by == "none"}
    assert {"shape", "kind", "reshaped", "only-ref"} <= unaligned  # alignment keeps them from the batch
    assert by_tensor["clip"].verdict == "pass" and by_tensor["fp8"].verdict == "fail"
    assert by_tensor["ints"].verdict == "fail" and by_tensor["ints"].metrics.mismatches == 1
    assert by_tensor["big"].metrics.numel == M.BATCH_MAX + 5
    assert by_tensor["empty"].metrics.numel == 0
    assert by_tensor["nonfinite"].metrics.nan_mismatch == 3  # target NaN at 4, 9 (reference Inf), 500
    assert by_tensor["nonfinite"].metrics.nan_where_ref_finite == 2


def test_a_real_capture_is_judged_the_same_measured_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo decoder captured in fp32 and in bfloat16: every op's result, batched or not."""
    torch = pytest.importorskip("torch")
    from hooks import capture
    from hooks.demo_model import build

    model, inputs = build()
    paths = []
    for variant, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        m = model.to(dtype)
        x = tuple(i.to(dtype) if i.is_floating_point() else i for i in inputs)
        path = tmp_path / f"{variant}.bundle"
        with torch.no_grad(), capture(m, path, run={"variant": variant, "device": "cpu"}):
            m(*x)
        paths.append(path)
    batched = compare(*paths)
    alone = _one_by_one(monkeypatch, *paths)
    assert len(batched.ops) > 50
    assert _as_rows(batched) == _as_rows(alone)


def test_a_batch_that_cannot_be_measured_leaves_each_pair_to_be_measured_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever fails while measuring ahead (here: mapping a bundle's bytes), the pairs are then measured
    one by one, with the same results, and nothing measured ahead stays behind."""
    ref, tgt = _branchy_pair(tmp_path)
    alone = _one_by_one(monkeypatch, ref, tgt)

    def refuse(self: Bundle) -> np.ndarray:
        raise OSError("mmap refused")

    monkeypatch.setattr(Bundle, "buffer", refuse)
    plan = compare_module.plan_comparison(ref, tgt)
    results = compare_module.judge_range(plan, 0, len(plan.pairs))
    assert not plan.context._ahead
    assert _as_rows(compare_module.conclude(plan, results)) == _as_rows(alone)
