"""Summary statistics: the fast CPU paths (fused C kernel and torch fallback) against float64 formulas."""

from __future__ import annotations

import ctypes
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hooks import cstats
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
    yield "huge", torch.tensor([3e38, -3e38, 1.0])  # finite, but the sum of squares overflows float32
    yield "huge-nan", torch.tensor([3e38, 3e38, float("nan"), 1.0])  # overflow and a NaN in one block
    yield "late-inf", torch.cat([torch.randn(5000, generator=g), torch.tensor([float("inf")])])  # in the last block
    yield "big", big  # split over threads
    yield "big-nan", big.clone().index_fill_(0, torch.arange(5, 3_000_000, 100_003), float("nan"))
    yield "big-double", torch.randn(1_200_001, generator=g, dtype=torch.float64)


CASES = list(_cases())


@pytest.fixture(params=["kernel", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "kernel":
        if cstats.load() is None:
            pytest.skip(f"statistics kernel unavailable: {cstats.unavailable_reason()}")
    else:
        monkeypatch.setattr(cstats, "_lib", None)
        monkeypatch.setattr(cstats, "_tried", True)
    return request.param


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
def test_host_stats_match_float64_formulas(name: str, x: torch.Tensor, path: str) -> None:
    want = reference(x)
    rtol = 1e-12 if x.dtype == torch.float64 or not x.is_floating_point() else 2e-6
    # float32 sums of values near the float32 maximum overflow in torch; the kernel sums such blocks in float64
    sums = not (name.startswith("huge") and path == "torch")
    _check(_row_dict(host_stats(x)), want, f"{name} ({path})", rtol, sums)


@pytest.mark.parametrize(("name", "x"), CASES[:12] + CASES[16:21], ids=[c[0] for c in CASES[:12] + CASES[16:21]])
def test_device_stats_match_float64_formulas(name: str, x: torch.Tensor) -> None:
    """The accelerator path (run here on CPU) keeps the same definitions."""
    _check(_row_dict(device_stats(x).tolist()), reference(x), name, 2e-5 if x.dtype != torch.float64 else 1e-12)


def test_kernel_thread_count_changes_only_rounding() -> None:
    if cstats.load() is None:
        pytest.skip(f"statistics kernel unavailable: {cstats.unavailable_reason()}")
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


def test_kernel_builds_where_a_compiler_exists() -> None:
    """A C compiler on PATH must give the fused kernel (a compile error would hide behind the fallback)."""
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("no C compiler on PATH")
    assert cstats.load() is not None, cstats.unavailable_reason()


def test_kernel_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPBAND_CSTATS", "0")
    cstats.reset()
    try:
        assert cstats.load() is None
        assert "OPBAND_CSTATS" in (cstats.unavailable_reason() or "")
        assert _row_dict(host_stats(torch.arange(4.0)))["mean"] == 1.5
    finally:
        monkeypatch.delenv("OPBAND_CSTATS")
        cstats.reset()


def test_empty_tensors_have_no_statistics() -> None:
    batch = StatsBatch()
    assert batch.add(torch.empty(0)) is None
    assert batch.add(torch.empty(3, 0, dtype=torch.bool)) is None
    assert batch.to_host() == []


def test_row_layout() -> None:
    row = host_stats(torch.tensor([1.0, 2.0]))
    assert len(row) == len(STAT_FIELDS) + SAMPLE_SIZE
    assert _row_dict(row)["sample"] == [1.0, 2.0]


def test_kernel_handles_empty_tensors_and_too_many_samples() -> None:
    """n == 0 divided by zero in the C code (SIGFPE); more indices than the output buffer overflowed it."""
    lib = cstats.load()
    if lib is None:
        pytest.skip(f"statistics kernel unavailable: {cstats.unavailable_reason()}")
    none = torch.empty(0, dtype=torch.int64)
    assert cstats.fused(torch.empty(0), none) == [math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert cstats.fused(torch.empty(0, dtype=torch.float64), none)[:2] == [math.inf, -math.inf]
    assert cstats.fused(torch.empty(0), torch.tensor([0])) is None  # no valid index into nothing
    out = (ctypes.c_double * cstats.N_HEAD)()
    assert lib.opband_stats(torch.empty(0).data_ptr(), 0, 0, 4, none.data_ptr(), 0, out) == 0  # the C guard
    x = torch.arange(1000.0)
    cap = 64  # the output buffer: N_HEAD + 64 values
    assert cstats.fused(x, torch.arange(cap + 1)) is None
    assert cstats.fused(x, torch.arange(cap))[cstats.N_HEAD:] == x[:cap].tolist()
    row = _row_dict(host_stats(torch.empty(0)))
    assert row["numel"] == 0 and row["nan"] == 0 and row["sample"] == []


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
