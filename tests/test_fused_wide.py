"""accuracy.fused's 512-bit vectors: which CPUs get them, that the attribute reaches the machine code,
and that the wide kernel's statistics are the narrow one's."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import pytest

from accuracy import fused


@pytest.mark.parametrize(("name", "features", "wide"), [
    ("sapphirerapids", "+avx2,+avx512f,+avx512bw", True),
    ("emeraldrapids", "+avx512f,-amx-tile", True),
    ("icelake-server", "+avx512f", True),
    ("znver4", "+avx512f,+avx512vl", True),
    ("skylake-avx512", "+avx512f,+avx512bw", False),  # clocks down for 512-bit float work
    ("cascadelake", "+avx512f", False),
    ("znver3", "+avx2,-avx512f", False),  # no AVX-512
    ("haswell", "+avx2", False),
    ("generic", "+avx512f", False),  # a portable cache (NUMBA_CPU_NAME=generic)
])
def test_which_targets_get_512_bit_vectors(name: str, features: str, wide: bool) -> None:
    assert fused._wide_target(name, features) is wide


def _fresh(wide: bool, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``_stats_more`` compiled now (no cache) with WIDE_VECTORS as given."""
    monkeypatch.setattr(fused, "WIDE_VECTORS", wide)
    kernel = numba.njit(nogil=True, fastmath=fused._FASTMATH, error_model="numpy")(fused._stats_more.py_func)
    kernel(np.ones(8, np.float32), fused.empty_head())  # compiles while WIDE_VECTORS holds
    return kernel


def _asm_and_attributes(kernel: Any) -> tuple[str, str]:
    """The kernel's machine code, and the LLVM attributes of its own function (callees linked into the
    module, e.g. the cached ``_masked64``, carry theirs)."""
    sig = kernel.signatures[0]
    ir = kernel.inspect_llvm(sig)
    name = f"@_ZN8accuracy5fused{len(kernel.__name__)}{kernel.__name__}"
    define = next(line for line in ir.splitlines() if line.startswith("define") and name in line)
    group = re.findall(r"#(\d+)\s*\{?\s*$", define)
    attrs = " ".join(line for line in ir.splitlines() if group and line.startswith(f"attributes #{group[0]} "))
    asm = kernel.inspect_asm(sig)
    label = name[1:] + next(iter(re.findall(re.escape(name) + r"([^(\s]*)\(", define)), "")
    own = asm[asm.index(label + ":"):]
    return own[:own.index(".Lfunc_end")], define + " " + attrs


def _tricky(rng: np.random.Generator) -> list[np.ndarray]:
    """Arrays over several STATS_BLOCKs and a partial one: normal values, signed zeros, a NaN/Inf block,
    values whose float32 squares overflow, subnormals, and bfloat16/float16 words."""
    n = 3 * fused.STATS_BLOCK + 77
    base = rng.standard_normal(n).astype(np.float32) * 3
    zeros = base.copy()
    zeros[::5], zeros[1::7] = 0.0, -0.0
    bad = base.copy()
    bad[fused.STATS_BLOCK + 3], bad[fused.STATS_BLOCK + 9], bad[-1] = np.nan, np.inf, -np.inf
    big = base * np.float32(1e30)  # squares overflow float32: the float64 redo
    tiny = (base * np.float32(1e-40)).astype(np.float32)
    bf16 = (base.view(np.uint32) >> 16).astype(np.uint16)
    f16 = base.astype(np.float16).view(np.int16)
    return [base, zeros, bad, big, tiny, base.astype(np.float64), bf16, f16]


def test_wide_kernel_summarises_as_the_narrow_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same min, max and counts, sums within float32 block rounding (the vector width only reorders
    the additions inside a block), against a float64 reference too."""
    arrays = _tricky(np.random.default_rng(3))
    heads, zmm = {}, {}
    for wide in (False, True):
        kernel = _fresh(wide, monkeypatch)
        asm, attributes = _asm_and_attributes(kernel)
        assert ('"prefer-vector-width"="512"' in attributes) is wide
        zmm[wide] = asm.count("zmm")  # the narrow one has some: the cached _masked64 it inlines is wide
        out = []
        for x in arrays:
            head = fused.empty_head()
            kernel(x, head)
            out.append(head)
        heads[wide] = out
    if fused._wide_target(*fused._numba_target()):  # this CPU runs 512-bit vectors: the main loop uses them
        import llvmlite.binding
        if llvmlite.binding.get_host_cpu_name() in ("znver4", "znver5"):
            # LLVM's tuning for these already prefers 512-bit vectors: the narrow kernel is as wide
            assert zmm[True] >= zmm[False] > 50, zmm
        else:
            assert zmm[True] > zmm[False] + 50, zmm
    for x, narrow, wide_head in zip(arrays, heads[False], heads[True]):
        exact = [0, 1, 4, 5, 6, 7]  # lo, hi, nan, inf, zeros, finite count
        assert np.array_equal(narrow[exact], wide_head[exact])
        np.testing.assert_allclose(wide_head[2:4], narrow[2:4], rtol=1e-5, atol=1e-30)
        if x.dtype == np.float32:
            v = x.astype(np.float64)
            fin = v[np.isfinite(v)]
            np.testing.assert_allclose(wide_head[2], fin.sum(), rtol=1e-5, atol=1e-3 * np.abs(fin).max() * 1e-3)
            np.testing.assert_allclose(wide_head[3], (fin * fin).sum(), rtol=1e-5, atol=1e-70)  # squares below float32's range: 0
            assert wide_head[6] == np.count_nonzero(fin == 0)


def test_kernels_with_hot_loops_ask_for_the_width() -> None:
    """A kernel with a hot loop asks for the width first (one edited without ``_wide()`` fails here)."""
    for kernel in (fused._stats_more, fused._masked64, fused._sums64, fused._error_kernel, fused._clip_kernel):
        body = inspect.getsource(kernel.py_func).split('"""')[-1]  # after the docstring
        assert body.lstrip().startswith("_wide()"), kernel.py_func.__name__


def test_error_kernel_divides_a_whole_vector_at_a_time() -> None:
    """The float32 block loop of the error kernel runs at least 8 lanes wide on an AVX2 host: its main
    loop's packed float32 division (the relative error) is on ymm/zmm registers. Counts kept as int64 beside
    float32 lanes made LLVM pick 4 lanes (xmm) and spill, 1.6x slower on Zen 3."""
    name, features = fused._numba_target()
    if "+avx2" not in features.split(","):
        pytest.skip(f"numba compiles for {name} without AVX2: no 8-lane float32 vectors to look for")
    kernel = numba.njit(nogil=True, fastmath=fused._FASTMATH, error_model="numpy")(fused._error_kernel.py_func)
    acc = fused.ErrorAccumulator(1e-6, 2.0**-126, 23, (1e-4, 1e-3, 5e-3))
    r = np.linspace(-2, 2, 1000, dtype=np.float32)
    t = r + np.float32(1e-3)
    kernel(r, t, *acc.args, acc.acc, acc.hist)  # compiled now, not from the cache: its machine code can be read
    divisions = re.findall(r"vdivps\s+([^\n]*)", kernel.inspect_asm(kernel.signatures[0]))
    # the main loop's; a vectorized remainder loop may divide on xmm (AVX-512 targets: zmm main, xmm epilogue)
    assert any("ymm" in d or "zmm" in d for d in divisions), divisions
    fused._error_kernel(r, t, *acc.args, acc.acc, acc.hist)  # and the cached kernel counts as this one
    assert acc.acc[fused.A["numel"]] == 2000 and acc.hist.sum() == 2000
    assert acc.acc[fused.A["rel_over_0"]] == 2 * np.count_nonzero(np.abs(t - r) / np.maximum(np.abs(r), 1e-6) > 1e-4)
