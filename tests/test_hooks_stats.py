"""Summary statistics: the CPU kernel (accuracy.fused, numba) and the device path against float64 formulas."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from accuracy import fused
from hooks.tensors import SAMPLE_SIZE, STAT_FIELDS, StatsBatch, _row_dict, device_stats, host_stats


def reference(x: torch.Tensor) -> dict[str, object]:
    """The definitions, in float64 with two passes: min/max/mean/std/l2/absmax over finite values."""
    v = x.detach().reshape(-1).to(torch.float64)
    fin = v[torch.isfinite(v)]
    n, c = v.numel(), fin.numel()
    mean = float(fin.sum()) / c if c else 0.0
    idx = torch.linspace(0, n - 1, min(SAMPLE_SIZE, n)).round().long()
    return {
        "numel": n,
        "min": float(fin.min()) if c else math.inf,
        "max": float(fin.max()) if c else -math.inf,
        "mean": mean,
        "std": math.sqrt(float(((fin - mean) ** 2).sum()) / c) if c else 0.0,
        "l2": math.sqrt(float((fin * fin).sum())),
        "absmax": float(fin.abs().max()) if c else -math.inf,
        "nan": int(torch.isnan(v).sum()),
        "inf": int(torch.isinf(v).sum()),
        "zeros": int((v == 0).sum()),
        "sample": v[idx].tolist(),
    }


def _cases() -> Iterator[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(3_000_000, generator=g)
    yield "randn", torch.randn(1000, generator=g)
    yield "one", torch.tensor([2.5])
    yield "scalar", torch.tensor(-3.0)
    yield "transposed", torch.randn(50, 7, generator=g).t()
    yield "strided", torch.randn(40, 40, generator=g)[:, ::3]
    yield "permuted-4d", torch.randn(2, 8, 16, 4, generator=g)[1:].permute(0, 2, 3, 1) * 2  # dense, not contiguous
    yield "expanded", torch.randn(3, 1, generator=g).expand(3, 5)
    # views whose flat reshape keeps a stride other than 1 (no copy): a kernel reading by address must not
    # take them as dense
    yield "slice-1d", torch.randn(40, generator=g)[::3]
    yield "column", torch.randn(8, 6, generator=g)[:, 0]
    yield "every-other-last", torch.randn(2, 4, 8, generator=g)[..., ::2]
    yield "expanded-1d", torch.tensor([2.0]).expand(100)
    yield "permuted-int", torch.arange(24).reshape(2, 3, 4).transpose(0, 2)
    yield "permuted-bool", (torch.randn(6, 5, generator=g) > 0).t()
    yield "offset-mean", torch.rand(300, generator=g) + 1e4  # one-pass variance would cancel
    yield "constant", torch.full((1000,), 7.25)
    yield "zeros", torch.zeros(5)
    yield "signed-zeros", torch.tensor([0.0, -0.0, 3.0, -0.0])
    yield "relu", torch.relu(torch.randn(10_000, generator=g))
    yield "int", torch.arange(-5, 10)
    yield "int8", torch.tensor([-128, 0, 127], dtype=torch.int8)
    yield "bool", torch.tensor([True, False, True])
    yield "half", torch.randn(64, generator=g).half()
    yield "bf16", torch.randn(64, generator=g).bfloat16()
    yield "double", torch.randn(100, generator=g).double()
    yield "nan-inf", torch.tensor([1.0, float("inf"), float("nan"), -2.0, 0.0])
    yield "all-nan", torch.full((3,), float("nan"))
    yield "all-inf", torch.tensor([float("inf"), float("-inf")])
    yield "neg-inf-zero", torch.tensor([float("-inf"), 0.0, -0.0])
    causal = torch.ones(128, 128, dtype=torch.bool).triu(1)
    yield "masked-scores", torch.randn(8, 128, 128, generator=g).masked_fill(causal, float("-inf"))
    yield "nan-double", torch.tensor([float("nan"), 1.0, -1.0], dtype=torch.float64)
    # transformers' causal mask: finfo.min added to the scores, finite, so float32 squares overflow in most blocks
    scores = torch.randn(4, 128, 128, generator=g)
    yield "finfo-min-mask", scores.masked_fill(causal, torch.finfo(torch.float32).min)
    yield "finfo-min-mask-f16", scores.half().masked_fill(causal, torch.finfo(torch.float16).min)
    yield "masked-scores-bf16", scores.bfloat16().masked_fill(causal, float("-inf"))
    yield "masked-scores-f16", scores.half().masked_fill(causal, float("-inf"))
    yield "masked-scores-double", scores.double().masked_fill(causal, float("-inf"))
    yield "softmax-masked", torch.softmax(scores.masked_fill(causal, float("-inf")), -1)  # half its values exact zeros
    yield "zero-heavy", torch.relu(torch.randn(20_000, generator=g) - 1.5)  # ~93% zeros, some blocks all zero
    yield "zero-heavy-bf16", torch.relu(torch.randn(20_000, generator=g) - 1.5).bfloat16()
    yield "huge", torch.tensor([3e38, -3e38, 1.0])  # finite, but the sum of squares overflows float32
    yield "huge-nan", torch.tensor([3e38, 3e38, float("nan"), 1.0])  # overflow and a NaN in one block
    yield "late-inf", torch.cat([torch.randn(5000, generator=g), torch.tensor([float("inf")])])  # in the last block
    yield "big", big  # split over threads
    yield "big-nan", big.clone().index_fill_(0, torch.arange(5, 3_000_000, 100_003), float("nan"))
    yield "big-double", torch.randn(1_200_001, generator=g, dtype=torch.float64)


CASES = list(_cases())


def _check(got: dict[str, object], want: dict[str, object], name: str, rtol: float, sums: bool = True) -> None:
    for k in ("numel", "nan", "inf", "zeros"):
        assert got[k] == want[k], (name, k, got[k], want[k])
    for k in ("min", "max", "absmax"):
        assert got[k] == want[k], (name, k, got[k], want[k])  # exact: no rounding in a min or max
    np.testing.assert_array_equal(got["sample"], want["sample"], err_msg=name)
    scale = max(float(want["l2"]) / math.sqrt(max(int(want["numel"]), 1)), 1e-30)  # RMS of the values
    for k in ("mean", "std", "l2") if sums else ():
        g, w = float(got[k]), float(want[k])  # type: ignore[arg-type]
        assert math.isclose(g, w, rel_tol=rtol, abs_tol=rtol * scale), (name, k, g, w)


@pytest.mark.parametrize(("name", "x"), CASES, ids=[c[0] for c in CASES])
def test_host_stats_match_float64_formulas(name: str, x: torch.Tensor) -> None:
    want = reference(x)
    rtol = 1e-12 if x.dtype == torch.float64 or not x.is_floating_point() else 2e-6
    _check(_row_dict(host_stats(x)), want, name, rtol)


_DEVICE_CASES = [c for c in CASES if c[0] in (
    "randn", "one", "scalar", "transposed", "strided", "permuted-4d", "expanded", "slice-1d", "column",
    "every-other-last", "expanded-1d", "permuted-int", "permuted-bool", "offset-mean", "constant", "zeros", "bool",
    "half", "bf16", "double", "nan-inf")]


@pytest.mark.parametrize(("name", "x"), _DEVICE_CASES, ids=[c[0] for c in _DEVICE_CASES])
def test_device_stats_match_float64_formulas(name: str, x: torch.Tensor) -> None:
    """The accelerator path (run here on CPU) keeps the same definitions."""
    _check(_row_dict(device_stats(x).tolist()), reference(x), name, 2e-5 if x.dtype != torch.float64 else 1e-12)


def test_kernel_thread_count_changes_only_rounding() -> None:
    x = torch.randn(4_000_000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = host_stats(x)
        torch.set_num_threads(4)
        four = host_stats(x)
    finally:
        torch.set_num_threads(threads)
    assert one[:3] == four[:3] and one[7:] == four[7:]  # counts, extremes, sample: exact
    np.testing.assert_allclose(one[3:7], four[3:7], rtol=1e-6)


_NO_COMPILER = """
import math, sys, numpy as np, torch
from hooks.tensors import host_stats, _row_dict
from accuracy.metrics import compare_arrays
x = torch.tensor([1.0, -2.0, 0.0, float("nan"), 4.0])
row = _row_dict(host_stats(x))
assert (row["min"], row["max"], row["nan"], row["zeros"], row["mean"]) == (-2.0, 4.0, 1, 1, 0.75), row
m = compare_arrays(np.array([1.0, 2.0], np.float32), np.array([1.0, 2.5], np.float32))
assert m.max_abs == 0.5 and m.max_rel == 0.25, m
print("ok")
"""


@pytest.mark.parametrize("cache", ["fresh", "unwritable"])
def test_kernels_need_no_compiler_and_no_writable_cache(tmp_path: Path, cache: str) -> None:
    """A server with no C compiler on PATH (and no CC) still gets the kernels: numba compiles with
    the LLVM in the llvmlite wheel. A cache directory that cannot be created costs only the cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "NUMBA_DISABLE_JIT")}
    env["PATH"] = str(tmp_path / "empty-bin")  # no cc, gcc or clang
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "cache") if cache == "fresh" else str(blocker / "cache")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = str(root)
    done = subprocess.run([sys.executable, "-c", _NO_COMPILER], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    if cache == "fresh":
        assert any((tmp_path / "cache").rglob("*.nbi")), "numba wrote no cache index"


def test_empty_tensors_have_no_statistics() -> None:
    batch = StatsBatch()
    assert batch.add(torch.empty(0)) is None
    assert batch.add(torch.empty(3, 0, dtype=torch.bool)) is None
    assert batch.to_host() == []


def test_row_layout() -> None:
    row = host_stats(torch.tensor([1.0, 2.0]))
    assert len(row) == len(STAT_FIELDS) + SAMPLE_SIZE
    assert _row_dict(row)["sample"] == [1.0, 2.0]


@pytest.mark.parametrize("n", [(1 << 24) + 4, (1 << 26) + 7])
def test_sample_indices_stay_inside_the_tensor(n: int) -> None:
    """float32 ``linspace`` rounds its last point to ``n`` for these sizes: the index must stop at ``n - 1``."""
    from hooks.tensors import _sample_index

    idx = _sample_index(n, torch.device("cpu"))
    assert int(idx[0]) == 0 and int(idx[-1]) == n - 1 and bool((idx[1:] >= idx[:-1]).all())


def test_the_sample_of_a_huge_tensor_ends_at_its_last_element() -> None:
    x = torch.arange((1 << 24) + 4, dtype=torch.int32)
    row = _row_dict(host_stats(x))
    assert row["sample"][0] == 0 and row["sample"][-1] == x.numel() - 1


def test_kernel_handles_empty_tensors_and_many_samples() -> None:
    out = fused.tensor_stats(np.zeros(0, np.float32))
    assert out.tolist() == [math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    x = np.arange(1000.0, dtype=np.float32)
    row = fused.stats_row(x, np.arange(200), "float32", len(fused.ROW_FIELDS) + 200)
    assert row[len(fused.ROW_FIELDS):].tolist() == x[:200].tolist() and row[0] == 1000 and row[2] == 999
    row = _row_dict(host_stats(torch.empty(0)))
    assert row["numel"] == 0 and row["nan"] == 0 and row["sample"] == []


def _block_mix(dtype: type, rng: np.random.Generator) -> np.ndarray:
    """Blocks of every kind the kernel tells apart, shuffled: plain, all-zero, float32-overflowing
    squares, -inf-masked, NaN, and both in one block."""
    big = float(np.finfo(dtype).max) / 2 if dtype != np.float64 else 3e38
    kinds = [rng.standard_normal(fused.STATS_BLOCK), np.zeros(fused.STATS_BLOCK), np.full(fused.STATS_BLOCK, -big),
             np.where(rng.random(fused.STATS_BLOCK) < 0.5, -np.inf, rng.standard_normal(fused.STATS_BLOCK)),
             np.where(rng.random(fused.STATS_BLOCK) < 0.01, np.nan, rng.standard_normal(fused.STATS_BLOCK)),
             np.r_[big, np.inf, np.nan, np.zeros(fused.STATS_BLOCK - 3)]]
    blocks = [kinds[i] for i in rng.integers(0, len(kinds), 60)]
    return np.concatenate([*blocks, rng.standard_normal(100)]).astype(dtype)  # and a short last block


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_kernel_head_matches_numpy_float64_on_every_block_kind(dtype: type) -> None:
    x = _block_mix(dtype, np.random.default_rng(1))
    v = x.astype(np.float64)
    fin = v[np.isfinite(v)]
    want = [fin.min(), fin.max(), fin.sum(), (fin * fin).sum(), np.isnan(v).sum(), np.isinf(v).sum(),
            (v == 0).sum(), fin.size]
    got = fused.tensor_stats(fused.kernel_array(x)).tolist()
    assert got[0:2] == want[0:2] and got[4:] == want[4:]
    rtol = 1e-12 if dtype == np.float64 else 2e-6
    for g, w, scale in ((got[2], want[2], np.abs(fin).sum()), (got[3], want[3], want[3])):
        assert math.isclose(g, w, rel_tol=rtol, abs_tol=rtol * scale), (g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_half_words_exactly(dtype: torch.dtype) -> None:
    """Every finite BF16/F16 value decodes exactly (subnormals, ±0, the largest), and Inf/NaN are counted."""
    words = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = words.view(dtype)
    v = x.double()
    fin = v[torch.isfinite(v)]
    row = _row_dict(host_stats(x))
    assert row["nan"] == int(torch.isnan(v).sum()) and row["inf"] == int(torch.isinf(v).sum())
    assert row["min"] == float(fin.min()) and row["max"] == float(fin.max()) and row["zeros"] == 2
    assert row["l2"] == pytest.approx(math.sqrt(float((fin * fin).sum())), rel=1e-6)
    assert row["mean"] == pytest.approx(float(fin.mean()), abs=1e-9 * float(fin.abs().max()))


def test_run_capture_rejects_an_unavailable_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU-only torch asked for cuda: a ValueError the CLI prints, not an AssertionError inside torch."""
    from hooks.runner import run_capture

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device cuda is not available in this torch build/machine: pass --device cpu"):
        run_capture("hooks.demo_model:build", tmp_path / "x.bundle", device="cuda")
    with pytest.raises(ValueError, match="device cuda:0 is not available"):
        run_capture("hooks.demo_model:build", tmp_path / "x.bundle", device="cuda:0", replay=tmp_path / "ref.bundle")
    with pytest.raises(ValueError, match="invalid device 'gpu0'"):
        run_capture("hooks.demo_model:build", tmp_path / "x.bundle", device="gpu0")
    assert not (tmp_path / "x.bundle").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_weight_prints_walk_chunks_to_the_one_pass_numbers(dtype: torch.dtype) -> None:
    """A weight's fingerprint is hashed and summarised chunk by chunk (hooks.fingerprints.CHUNK_BYTES):
    its digest is the xxh3-128 of all its bytes, and its head is exactly the single pass's, NaN/Inf
    (one in the first chunk, one on a chunk boundary, one in the short last chunk) counted and left out."""
    import xxhash

    from hooks.fingerprints import CHUNK_BYTES, tensor_print

    g = torch.Generator().manual_seed(7)
    per = CHUNK_BYTES // torch.empty(0, dtype=dtype).element_size()
    x = (torch.randn(3 * per + 1234, generator=g, dtype=torch.float64) * 3 + 0.5).to(dtype)
    x[[5, per, 3 * per + 1000]] = torch.tensor([float("nan"), float("-inf"), float("inf")], dtype=dtype)
    fp = tensor_print(x)
    assert fp is not None
    assert fp.digest == xxhash.xxh3_128_hexdigest(x.view(torch.uint8).numpy().tobytes())
    words = x.view(torch.int16).numpy() if x.element_size() == 2 else x.numpy()
    head = fused.tensor_stats(fused.kernel_array(words, {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(dtype)))
    count = int(head[7])
    assert fp.nonfinite == 3 and count == x.numel() - 3
    assert (fp.sum, fp.l2, fp.absmax) == (head[2] / count * count, math.sqrt(head[3]), max(-head[0], head[1]))
    v = x.to(torch.float64)
    fin = v[torch.isfinite(v)]
    assert fp.absmax == float(fin.abs().max())
    rtol = 1e-12 if dtype == torch.float64 else 2e-6
    assert fp.l2 == pytest.approx(float(fin.norm()), rel=rtol)
    assert fp.sum == pytest.approx(float(fin.sum()), rel=rtol, abs=rtol * float(fin.abs().sum()))


_TRITON_CASES = """
import math, sys, torch
sys.path.insert(0, sys.argv[1])
import test_hooks_stats as T
from hooks import tensors
from hooks.tensors import _row_dict, device_stats

def torch_path(values):
    raise AssertionError("device_stats left the Triton kernels for the torch ops")

tensors.torch_device_stats = torch_path
names = sys.argv[2].split(",")
g = torch.Generator().manual_seed(5)
cases = [c for c in T.CASES if c[0] in names] + [("many-programs", torch.randn(1_100_001, generator=g) * 3 + 1)]
for name, x in cases:
    for v in [x.to(dt) for dt in (torch.float32, torch.bfloat16, torch.float16)] if x.is_floating_point() else [x]:
        T._check(_row_dict(device_stats(v).tolist()), T.reference(v), f"{name} {v.dtype}", 2e-5)
print("ok", len(cases))
"""


def test_triton_kernels_match_float64_formulas() -> None:
    """The CUDA path's two Triton kernels (``hooks.triton_stats``) under ``TRITON_INTERPRET=1``, here on
    CPU tensors (CI has no GPU; the H200 check runs them compiled): the same row as the float64
    definitions for float32/bf16/fp16, integer and bool tensors, NaN/Inf, zero-heavy, permuted, one-program
    and multi-program (> 256K elements) tensors, and never the torch-ops fallback."""
    names = ["randn", "one", "scalar", "transposed", "strided", "permuted-4d", "expanded", "offset-mean", "constant",
             "zeros", "signed-zeros", "relu", "nan-inf", "all-nan", "all-inf", "neg-inf-zero", "masked-scores",
             "softmax-masked", "zero-heavy", "late-inf", "int", "int8", "bool", "permuted-int", "permuted-bool",
             "slice-1d", "column", "every-other-last", "expanded-1d"]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _TRITON_CASES, str(root / "tests"), ",".join(names)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip() == f"ok {len(names) + 1}", done.stderr[-3000:]


def test_triton_takes_plain_tensors_of_its_dtypes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor subclasses (no memory of their own to read by address), float64 and complex tensors keep
    the torch path (a failure there would switch Triton off for every tensor); CPU tensors take Triton
    only under the interpreter."""
    from hooks import triton_stats

    class Tagged(torch.Tensor):
        pass

    x = torch.randn(8)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_stats.usable_for(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_stats.usable_for(x) and triton_stats.usable_for(torch.nn.Parameter(x))
    assert triton_stats.usable_for(x.bfloat16()) and triton_stats.usable_for(torch.arange(3))
    assert not any(triton_stats.usable_for(t) for t in (x.double(), x.to(torch.complex64), x.as_subclass(Tagged)))
