"""Metrics against hand-computed values and float64 recomputations; both kernels agree."""

from __future__ import annotations

import math

import numpy as np
import pytest

from accuracy import metrics as M
from accuracy.budgets import DTYPE_MAX
from accuracy.manifest import Stats
from accuracy.metrics import compare_arrays, compare_discrete, compare_stats, histogram_quantile


def test_hand_computed_four_elements() -> None:
    r = np.array([1, 2, 3, 4], np.float32)
    t = np.array([1, 2.5, 3, 3], np.float32)  # errors 0, +0.5, 0, -1
    m = compare_arrays(r, t)
    assert m.numel == 4 and m.max_abs == 1.0 and m.mean_abs == 0.375
    assert m.rmse == pytest.approx(math.sqrt(1.25 / 4), rel=1e-12)
    assert m.max_rel == 0.25 and m.mean_rel == 0.125
    assert m.cosine == pytest.approx(27 / math.sqrt(30 * 25.25), rel=1e-12)
    assert m.norm_l2 == pytest.approx(math.sqrt(1.25 / 30), rel=1e-12)
    assert m.snr_db == pytest.approx(10 * math.log10(30 / 1.25), rel=1e-12)
    assert m.error_balance == pytest.approx(-1 / 3, rel=1e-12)
    assert m.exact_share == 0.5
    assert m.share_rel_over == {"1e-04": 0.5, "1e-03": 0.5, "5e-03": 0.5}
    # float32 ulp at 2 is 2^-22 and at 4 is 2^-21: both errors are 2^21 ulps
    assert m.ulp_max == 2.0**21 and m.ulp_mean == 2.0**20 and m.share_over_1ulp == 0.5
    assert m.nan_mismatch == m.inf_mismatch == m.nan_where_ref_finite == 0
    assert sum(m.histogram) == 4 and m.histogram[0] == 2
    assert not m and compare_arrays(r, r)


def test_identical_tensors() -> None:
    r = np.linspace(-3, 3, 1001, dtype=np.float32)
    m = compare_arrays(r, r.copy())
    assert bool(m) and m.max_abs == 0 and m.cosine == 1.0 and m.snr_db == math.inf and m.exact_share == 1.0
    assert m.quantiles == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "p99.9": 0.0}


def _one_minus_cos(r: np.ndarray, t: np.ndarray) -> float:
    """1 - cos(r, t) without cancellation: (|d|^2 - (|r| - |t|)^2) / (2 |r| |t|), sums by math.fsum.

    ``1 - dot / (|r| |t|)`` in float64 loses its digits near 1e-15 (BLAS dot order: OpenBLAS's Haswell
    kernel gave 6.55e-15 for a true 5.26e-15), so it cannot be the reference for a kernel that is right.
    """
    d = t - r
    nr, nt = math.sqrt(math.fsum(r * r)), math.sqrt(math.fsum(t * t))
    return (math.fsum(d * d) - (nr - nt) ** 2) / (2 * nr * nt)


def _fp64(r: np.ndarray, t: np.ndarray, guard: float, mant: int = 23, tiny: float = 2.0**-126) -> dict[str, float]:
    r, t = r.astype(np.float64), t.astype(np.float64)
    d = t - r
    rel = np.abs(d) / np.maximum(np.abs(r), guard)
    _, e = np.frexp(np.maximum(np.abs(r), tiny))
    ulps = np.abs(d) / np.ldexp(1.0, e - 1 - mant)
    return {
        "max_abs": np.abs(d).max(), "mean_abs": np.abs(d).mean(), "rmse": math.sqrt((d * d).mean()),
        "max_rel": rel.max(), "mean_rel": rel.mean(), "norm_l2": np.linalg.norm(d) / np.linalg.norm(r),
        "one_minus_cos": _one_minus_cos(r, t),
        "ulp_max": ulps.max(), "ulp_mean": ulps.mean(), "share_over_1ulp": (ulps > 1).mean(),
        "error_balance": d.sum() / np.abs(d).sum(), "share_1e-03": (rel > 1e-3).mean(),
    }


def _one_minus_cos(r: np.ndarray, t: np.ndarray) -> float:
    """1 - cos(r, t) in extended precision: float64's ``1 - dot / (|r| |t|)`` is off by ~1e-15,
    as much as the value itself when the two are nearly parallel."""
    R, T = r.astype(np.longdouble), t.astype(np.longdouble)
    return float(1 - (R * T).sum() / np.sqrt((R * R).sum() * (T * T).sum()))


@pytest.mark.parametrize("scale,noise,n", [(1.0, 1e-3, 200_003), (1e-20, 1e-6, 70_000), (1e12, 3e-2, 131_072),
                                           (1.0, 1e-7, 65_537)])
def test_fast_kernel_matches_float64(scale: float, noise: float, n: int) -> None:
    rng = np.random.default_rng(7)
    r = (rng.standard_normal(n) * scale).astype(np.float32)
    t = (r.astype(np.float64) * (1 + noise * rng.standard_normal(n))).astype(np.float32)
    m = compare_arrays(r, t, ref_absmax=float(np.abs(r).max()))
    ref = _fp64(r, t, guard=M.machine_eps("float32") * float(np.abs(r).max()))
    for name in ("max_abs", "max_rel", "ulp_max"):
        assert getattr(m, name) == pytest.approx(ref[name], rel=1e-6), name
    for name in ("mean_abs", "rmse", "mean_rel", "norm_l2", "ulp_mean", "error_balance"):
        assert getattr(m, name) == pytest.approx(ref[name], rel=1e-5), name
    assert m.share_over_1ulp == pytest.approx(ref["share_over_1ulp"], abs=1e-6)
    assert m.share_rel_over["1e-03"] == pytest.approx(ref["share_1e-03"], abs=2 / n)
    # 1 - cosine keeps its digits even when it is ~1e-14
    assert 1 - m.cosine == pytest.approx(ref["one_minus_cos"], rel=2e-3, abs=1e-15)


def test_fast_and_exact_kernels_agree() -> None:
    rng = np.random.default_rng(3)
    r = rng.standard_normal(100_000).astype(np.float32)
    t = (r + rng.standard_normal(100_000).astype(np.float32) * 1e-4).astype(np.float32)
    fast = compare_arrays(r, t)
    exact = compare_arrays(r.astype(np.float64), t.astype(np.float64))  # float64 inputs take the exact kernel
    for name in ("max_abs", "max_rel", "ulp_max", "exact_share", "share_over_1ulp"):
        assert getattr(fast, name) == pytest.approx(getattr(exact, name), rel=1e-6), name
    for name in ("mean_abs", "rmse", "mean_rel", "norm_l2", "ulp_mean", "error_balance", "snr_db"):
        assert getattr(fast, name) == pytest.approx(getattr(exact, name), rel=1e-5), name
    assert fast.histogram == exact.histogram and fast.share_rel_over == exact.share_rel_over


def test_chunking_does_not_change_results() -> None:
    rng = np.random.default_rng(5)
    r = rng.standard_normal(150_001).astype(np.float32)
    t = (r * (1 + 1e-3 * rng.standard_normal(150_001))).astype(np.float32)
    whole = compare_arrays(r, t)
    pieces = compare_arrays((r[i : i + 7777] for i in range(0, r.size, 7777)),
                            (t[i : i + 7777] for i in range(0, t.size, 7777)))
    assert whole.histogram == pieces.histogram and whole.max_rel == pieces.max_rel
    assert whole.norm_l2 == pytest.approx(pieces.norm_l2, rel=1e-6)


def test_ulps_at_the_target_dtype() -> None:
    r = np.array([1.0, 1.0, 3.0], np.float32)
    t = np.array([1.0 + 2**-7, 1.0 + 2**-8, 3.0], np.float32)
    m = compare_arrays(r, t, "bfloat16")  # bf16 ulp at 1 is 2^-7, at 3 is 2^-6
    assert m.ulp_max == 1.0 and m.ulp_mean == pytest.approx(0.5) and m.share_over_1ulp == 0.0
    z = compare_arrays(np.array([0.0, 0.0], np.float32), np.array([2.0**-149, 0.0], np.float32))
    assert z.ulp_max == 1.0  # the smallest float32 subnormal is one ulp from zero
    h = compare_arrays(np.array([0.0], np.float32), np.array([2.0**-24], np.float32), "float16")
    assert h.ulp_max == 1.0  # float16's smallest subnormal


def test_relative_error_guard() -> None:
    r = np.array([100.0, 1e-30], np.float32)
    t = np.array([100.0, 2e-30], np.float32)
    unguarded = compare_arrays(r, t)
    assert unguarded.max_rel == pytest.approx(1.0, rel=1e-6)  # 1e-30 is above float32's tiny
    guarded = compare_arrays(r, t, ref_absmax=100.0)  # guard = 2^-24 * 100
    assert guarded.max_rel == pytest.approx(1e-30 / (100 * 2**-24), rel=1e-5)


def test_nan_and_inf_are_outcomes_of_their_own() -> None:
    r = np.array([1.0, np.nan, np.inf, -np.inf, 2.0, np.inf, 3.0], np.float32)
    t = np.array([np.nan, np.nan, np.inf, np.inf, 2.0, 5.0, 3.0], np.float32)
    m = compare_arrays(r, t)
    assert m.nan_where_ref_finite == 1 and m.nan_mismatch == 1
    assert m.inf_mismatch == 2  # sign flip, and inf where the target is finite
    assert m.exact_share == pytest.approx(4 / 7)  # equal NaN, equal +inf, and two equal finite values
    assert m.max_abs == 0.0 and not m.finite_outcome and not m


def test_float32_overflow_of_the_difference_falls_back_to_float64() -> None:
    m = compare_arrays(np.array([3e38], np.float32), np.array([-3e38], np.float32))
    assert m.max_abs == pytest.approx(6e38, rel=1e-6) and m.histogram[-1] == 1


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_finite_blocks_beyond_float32_range_equal_the_float64_suite(stored: str) -> None:
    """An attention mask (half of it ``finfo(float32).min``: finite, but its squares overflow float32) is
    judged in float64 blocks: every metric as the float64 suite computes it on the same values, and a
    block with a NaN next to such blocks still counts its NaN."""
    rng = np.random.default_rng(11)
    n = 2 * 512 + 77  # two mask blocks, then a short block with a NaN (element by element, float64)
    r = rng.standard_normal(n).astype(np.float32)
    r[: 2 * 512 : 2] = np.finfo(np.float32).min
    t = r.copy()
    t[1::2] = (r[1::2].astype(np.float64) * (1 + 2.0**-9 * rng.standard_normal(n // 2))).astype(np.float32)
    t[-5] = np.nan
    if stored == "bfloat16":
        words = (t.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16 words
        t = (words.astype(np.uint32) << 16).view(np.float32)
        fast = compare_arrays(r, words, "bfloat16", stored_dtype="BF16")
    else:
        fast = compare_arrays(r, t, "float32")
    exact = compare_arrays(r.astype(np.float64), t.astype(np.float64), stored)
    assert fast.nan_where_ref_finite == exact.nan_where_ref_finite == 1
    for name in ("max_abs", "max_rel", "ulp_max", "share_over_1ulp", "exact_share"):
        assert getattr(fast, name) == getattr(exact, name), name
    for name in ("mean_abs", "rmse", "mean_rel", "norm_l2", "ulp_mean", "cosine"):
        assert getattr(fast, name) == pytest.approx(getattr(exact, name), rel=1e-12), name
    assert fast.histogram == exact.histogram and fast.share_rel_over == exact.share_rel_over


@pytest.mark.parametrize("stored", [None, "BF16"])
def test_clip_judges_both_sides_within_the_target_range(stored: str | None) -> None:
    """``clip``: both sides clamped to the target dtype's range in the kernel's read (Inf and finite
    values beyond it alike, NaN kept), equal to clamping by hand first; chunked and whole alike."""
    top = DTYPE_MAX["bfloat16"]
    rng = np.random.default_rng(3)
    r = rng.standard_normal(5000).astype(np.float32)
    r[::7] = np.finfo(np.float32).min  # beyond bf16's range
    r[5] = np.nan
    t = r.copy()
    t[::7] = -np.inf  # what bf16 rounds finfo.min to
    t[1::7] += np.float32(0.01)
    words = (t.view(np.uint32) >> 16).astype(np.uint16)
    decoded = (words.astype(np.uint32) << 16).view(np.float32)
    target, tag = (words, "BF16") if stored else (decoded, None)
    m = compare_arrays(r, target, "bfloat16", top, stored_dtype=tag, clip=top)
    by_hand = compare_arrays(np.clip(r, -top, top), np.clip(decoded, -top, top), "bfloat16", top)
    assert m == by_hand
    assert m.inf_mismatch == 0 and m.nan_mismatch == 0 and m.exact_share >= len(r[::7]) / r.size  # masks equal
    chunks = compare_arrays((np.clip(r, -top, top)[i : i + 999] for i in range(0, r.size, 999)),
                            (target[i : i + 999] for i in range(0, r.size, 999)), "bfloat16", top,
                            stored_dtype=tag, clip=top)
    assert chunks.histogram == m.histogram and chunks.max_abs == m.max_abs
    unclipped = compare_arrays(r, target, "bfloat16", top, stored_dtype=tag)
    assert unclipped.inf_mismatch == len(r[::7])  # without clip: -inf against a finite reference


def test_quantiles_from_the_histogram() -> None:
    r = np.zeros(1000, np.float64)
    t = np.full(1000, 1e-3)
    t[-1] = 1.0
    m = compare_arrays(r, t)
    assert 1e-3 / 1.25 <= m.quantiles["p50"] <= 1e-3 * 1.25
    assert 1e-3 / 1.25 <= m.quantiles["p99.9"] <= 1e-3 * 1.25
    t[-10:] = 1.0
    m = compare_arrays(r, t)
    assert 1.0 / 1.25 <= m.quantiles["p99.9"] <= 1.25 and m.quantiles["p99"] <= 1.25e-3
    assert histogram_quantile([0] * M.HIST_SLOTS, 0.5) == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_compiled_quantiles_equal_histogram_quantile(seed: int) -> None:
    """The metric suite's quantiles (interpolated in the compiled histogram fold) are exactly what
    :func:`histogram_quantile` reads from the same histogram, in every kind of slot: exact zeros, below
    the lowest edge, interior and overflow."""
    rng = np.random.default_rng(seed)
    r = rng.standard_normal(5000).astype(np.float32)
    err = r * rng.choice([0.0, 1e-30, 1e-6, 1e-3, 0.5, 1e30], size=r.size, p=[0.3, 0.05, 0.3, 0.2, 0.1, 0.05])
    m = compare_arrays(r, (r + err).astype(np.float32))
    assert sum(m.histogram) == r.size
    for q in M.QUANTILES:
        assert m.quantiles[M._qname(q)] == histogram_quantile(m.histogram, q)
    assert compare_arrays(r[:0], r[:0]).quantiles == dict.fromkeys(m.quantiles, 0.0)


def test_histogram_slots_cover_the_edges() -> None:
    errs = np.array([0.0, 2.0**-45, 2.0**-40, 1.0, 1.3, 2.0**16, np.float32(3e38)], np.float32)
    m = compare_arrays(np.zeros_like(errs), errs)
    h = m.histogram
    assert h[0] == 1 and h[1] == 1 and h[2] == 1 and h[-1] == 2
    one = 2 + (0 - M.HIST_LOW_EXP) * M.HIST_PER_OCTAVE
    assert h[one] == 1 and h[one + 1] == 1  # 1.0 in [1, 1.25), 1.3 in [1.25, 1.5)
    assert M.slot_bounds(one) == (1.0, 1.25)


def test_discrete_mismatch_count() -> None:
    r = np.arange(10, dtype=np.int64)
    t = r.copy()
    t[[2, 7]] = [5, -1]
    m = compare_discrete(r, t)
    assert m.mismatches == 2 and m.max_abs == 8.0 and m.exact_share == 0.8 and not m
    assert compare_discrete(np.array([True, False]), np.array([True, False])).mismatches == 0


def test_summary_statistics_deltas_bound_the_error() -> None:
    rng = np.random.default_rng(0)
    r = rng.standard_normal(10_000)
    t = r * 1.01 + 0.002
    def stats(x: np.ndarray) -> Stats:
        return Stats(numel=x.size, min=x.min(), max=x.max(), mean=x.mean(), std=x.std(), l2=float(np.linalg.norm(x)),
                     absmax=float(np.abs(x).max()), sample=x[:: 10_000 // 16][:16].tolist())
    m = compare_stats(stats(r), stats(t))
    true = compare_arrays(r, t)
    assert m.source == "summary" and m.stats_delta is not None
    assert m.stats_delta["std"] == pytest.approx(0.01, rel=1e-6)
    assert m.norm_l2 <= true.norm_l2 * 1.3 and m.norm_l2 >= 0.5 * true.norm_l2
    assert m.max_abs <= true.max_abs + 1e-12
    assert m.get("delta_l2") == m.stats_delta["l2"]


def test_as_dict_is_json_safe() -> None:
    import json

    m = compare_arrays(np.array([1.0, 0.0], np.float32), np.array([1.0, 0.0], np.float32))
    json.dumps(m.as_dict(), allow_nan=False)
    assert m.as_dict()["snr_db"] == "inf" and m.get("p99") == 0.0 and m.get("share_rel_over_1e-03") == 0.0


def test_exact_chunks_and_subnormal_errors_match_the_float64_kernel() -> None:
    rng = np.random.default_rng(11)
    n = 4 * M.CHUNK + 123
    r = rng.standard_normal(n).astype(np.float32)
    t = r.copy()
    t[M.CHUNK : 2 * M.CHUNK] = (r[M.CHUNK : 2 * M.CHUNK] * (1 + 1e-3 * rng.standard_normal(M.CHUNK))).astype(np.float32)
    t[3 * M.CHUNK :: 5] += np.float32(1e-4)  # chunks 0 and 2 stay exact
    r[M.CHUNK : 2 * M.CHUNK : 7] = np.float32(3e-39)  # subnormal errors inside a fast-path chunk
    t[M.CHUNK : 2 * M.CHUNK : 7] = np.float32(3e-39) + np.float32(2e-44) * (np.arange(M.CHUNK)[::7] % 3)
    fast = compare_arrays(r, t, ref_absmax=4.0)
    exact = compare_arrays(r.astype(np.float64), t.astype(np.float64), ref_absmax=4.0)
    assert fast.histogram == exact.histogram and fast.exact_share == exact.exact_share
    assert fast.share_rel_over == exact.share_rel_over and fast.share_over_1ulp == exact.share_over_1ulp
    for name in ("max_abs", "max_rel", "ulp_max"):
        assert getattr(fast, name) == pytest.approx(getattr(exact, name), rel=1e-6), name
    for name in ("mean_abs", "rmse", "mean_rel", "ulp_mean", "norm_l2"):
        assert getattr(fast, name) == pytest.approx(getattr(exact, name), rel=1e-5), name


def test_both_float16_decodes_are_exact_on_every_word() -> None:
    """Stored float16 words are decoded in the kernels' registers: by the CPU's conversion instruction where
    it has F16C, else by integer and float32 operations. Each (that this CPU can run) gives numpy's value
    for all 65,536 words (signed zeros, subnormals, Inf, NaN)."""
    import numba

    from accuracy import fused

    decoders = [fused._f16_portable] + ([fused._f16_fpext] if fused.F16C else [])
    words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.int16)
    expected = words.view(np.float16).astype(np.float32)
    for decode in decoders:
        @numba.njit
        def decode_all(w, out, decode=decode):  # type: ignore[no-untyped-def]
            for i in range(w.shape[0]):
                out[i] = decode(w[i])

        out = np.empty(words.size, np.float32)
        decode_all(words, out)
        assert np.array_equal(out.view(np.uint32)[~np.isnan(expected)], expected.view(np.uint32)[~np.isnan(expected)])
        assert np.array_equal(np.isnan(out), np.isnan(expected))


@pytest.mark.parametrize("kind", ["f32", "f64", "bf16-words", "f16", "non-finite", "empty"])
def test_small_pairs_take_one_call_with_the_accumulators_numbers(kind: str) -> None:
    """Pairs below PARALLEL_MIN go through fused.batch_summary into per-thread scratch buffers: every
    field equals what the ErrorAccumulator and error_summary path gives, bit for bit."""
    rng = np.random.default_rng(3)
    r = rng.standard_normal(1000).astype(np.float32) * 10.0
    t, target, stored = (r * (1 + 1e-3)).astype(np.float32), "float32", None
    if kind == "f64":
        r, t = r.astype(np.float64), (r * (1 + 1e-9)).astype(np.float64)
        target = "float64"
    elif kind == "bf16-words":
        t, target, stored = ((r.view(np.uint32) + 0x8000) >> 16).astype(np.uint16), "bfloat16", "BF16"
    elif kind == "f16":
        t, target = r.astype(np.float16), "float16"
    elif kind == "non-finite":
        t = t.copy()
        t[[3, 70]] = np.nan
        r = r.copy()
        r[[5, 70]] = np.inf
    elif kind == "empty":
        r, t = r[:0], t[:0]
    fast = M.compare_arrays(r, t, target, float(np.nanmax(np.abs(r))) if r.size else None, stored_dtype=stored)
    acc = M._accumulator(target, float(np.nanmax(np.abs(r))) if r.size else None)
    acc.add(M._kernel_input(r, None), M._kernel_input(t, stored))
    slow = M._finish(acc)
    assert fast.as_dict() == slow.as_dict()
    again = M.compare_arrays(r[: len(r) // 2], t[: len(t) // 2], target, stored_dtype=stored)  # scratch reused
    assert again.numel == len(r) // 2 and fast.as_dict() == slow.as_dict()
