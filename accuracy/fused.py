"""One pass over memory for every elementwise number opband computes, compiled by numba.

Two kernels, used everywhere (capture statistics in ``hooks``, the metric suite in ``accuracy``):

- :func:`tensor_stats`: min, max, sum and sum of squares over the finite values, NaN/Inf/zero
  counts and the sampled elements of one array;
- :class:`ErrorAccumulator` (``_error_kernel``): the whole error distribution of a (reference,
  target) pair (sums, maxima, threshold counts, NaN/Inf bookkeeping and the exact histogram) into an
  accumulator that chunks and threads add to; :func:`clipped` clamps a side to a dtype's range in the
  same decode (a reference beyond the target's range).

numba compiles them with the LLVM inside the ``llvmlite`` wheel (no C compiler at run time) on
first use and caches the machine code on disk (``NUMBA_CACHE_DIR``; default ``__pycache__`` next to
this file, else numba's per-user cache). Arrays are read in their stored form: ``float32``,
``float64``, bfloat16 as its ``uint16`` words and float16 as its ``int16`` words (numba has no
float16 arithmetic), decoded in registers (float16 by the CPU's ``vcvtph2ps`` where it has F16C,
:data:`F16C`, else by integer operations); 16/32-bit values are worked in float32 within a block,
float64 across blocks (see each kernel).

Each kernel walks blocks (:data:`BLOCK` elements, :data:`STATS_BLOCK` for the statistics) with a
branch-free loop the compiler vectorizes; a block with a NaN or Inf is redone by a float64 loop that keeps their books, and a
finite block beyond float32's range (``finfo.min`` attention masks) by the same vectorized loop in
float64, so the finite path pays nothing for either. Arrays over :data:`PARALLEL_MIN` elements are split
over threads (the kernels release the GIL); partial results are combined in a fixed order, so a
result depends on the thread count only through the rounding of its sums.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from accuracy.capture_format import DTYPES, KERNEL_DTYPES, STAT_FIELDS

BLOCK = 512
#: The statistics kernel's block: its loop carries five accumulators, whose horizontal reductions
#: and float64 merges cost as much as ~500 elements of work, so longer blocks pay off (4096: ~1.5x
#: the element rate of 512 on cache-resident float32; each vector lane still sums at most 4096/16
#: float32 values).
STATS_BLOCK = 4096
#: Arrays of at least this many elements are split over threads.
PARALLEL_MIN = 1 << 20
_FASTMATH = {"reassoc", "nsz", "contract"}  # reorder sums (to vectorize) but keep NaN/Inf semantics

#: ``tensor_stats`` output head: lo, hi, sum, sumsq over finite values; nan, inf, zeros, finite count.
N_STATS = 8

#: :class:`ErrorAccumulator` fields (float64; counts are exact below 2^53).
ACC_FIELDS = ("numel", "finite", "exact", "nan_mismatch", "inf_mismatch", "nan_where_ref_finite",
              "sum_abs", "sum_err", "sum_sq_err", "sum_sq_ref", "dot_dr", "sum_rel", "sum_ulp",
              "max_abs", "max_rel", "ulp_max", "over_ulp", "rel_over_0", "rel_over_1", "rel_over_2")
A = {name: i for i, name in enumerate(ACC_FIELDS)}
_MAX_FIELDS = (A["max_abs"], A["max_rel"], A["ulp_max"])
#: Histogram code of |error|: 0 for exact zeros, else 1 + (float32 bits of |error| >> 21).
N_CODES = 1 + (1 << 10)
HIST_SHIFT = 21


# -- vector width ----------------------------------------------------------------------------------
#: LLVM CPU models with AVX-512 whose cores clock down for 512-bit floating-point work (the first
#: AVX-512 server cores): there the kernels keep LLVM's 256-bit vectors.
_DOWNCLOCKING = frozenset({"skylake-avx512", "cascadelake", "cooperlake", "knl", "knm"})


def _wide_target(name: str, features: str) -> bool:
    """Whether numba's target CPU (LLVM's ``name`` and ``+feature,-feature`` list) has AVX-512 that
    LLVM would leave unused: its tuning for Ice Lake and later Intel cores prefers 256-bit vectors,
    which halves the element rate of a kernel limited by its arithmetic (docs/capture.md has the
    measurements). Numba's cache keys
    hold the target's name and features, so cached machine code always matches this choice."""
    return name != "generic" and "+avx512f" in features.split(",") and name not in _DOWNCLOCKING


def _numba_target() -> tuple[str, str]:
    """The CPU name and features numba compiles for (``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES`` or the host's)."""
    try:
        from llvmlite import binding
        from numba.core import config

        return (config.CPU_NAME or binding.get_host_cpu_name(),
                config.CPU_FEATURES or binding.get_host_cpu_features().flatten())
    except Exception:  # noqa: BLE001 - no CPU description: LLVM's default width
        return "generic", ""


#: the kernels ask LLVM for 512-bit vectors (see :func:`_wide_target`)
WIDE_VECTORS = _wide_target(*_numba_target())


@intrinsic
def _wide(typingctx: Any) -> Any:
    """First statement of a kernel with a hot loop: on a :data:`WIDE_VECTORS` target, the function
    asks LLVM for 512-bit vectors (the ``prefer-vector-width`` attribute, as clang's
    ``-mprefer-vector-width=512`` sets; llvmlite's attribute set knows only enum attributes, hence
    ``set.add``). The kernel is vectorized in its own module, so callers that inline it keep its
    vectors (the compiled observer's row function among them; ``tests/test_fused_wide.py``)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        if WIDE_VECTORS:
            set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return types.none(), codegen


# -- bit casts (LLVM bitcast: free) ---------------------------------------------------------------
def _bitcast(src: types.Type, dst: types.Type, width: int) -> Any:
    @intrinsic
    def cast(typingctx: Any, x: Any) -> Any:
        if x != src:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            target = ir.DoubleType() if dst == types.float64 else ir.FloatType() if dst == types.float32 \
                else ir.IntType(width)
            return builder.bitcast(args[0], target)

        return dst(src), codegen

    return cast


_f64_bits = _bitcast(types.float64, types.int64, 64)
_bits_f64 = _bitcast(types.int64, types.float64, 64)
_f32_bits = _bitcast(types.float32, types.int32, 32)
_bits_f32 = _bitcast(types.int32, types.float32, 32)


def _load(x, i):  # type: ignore[no-untyped-def]  # no annotations: numba compares signatures
    """Element ``i`` of a kernel array as float64 (see the module docstring for the encodings)."""
    raise NotImplementedError  # numba only


def _load32(x, i):  # type: ignore[no-untyped-def]
    """Element ``i`` of a 16/32-bit kernel array as float32 (exact)."""
    raise NotImplementedError  # numba only


def _f16_to_f32(h):  # type: ignore[no-untyped-def]
    raise NotImplementedError  # numba only


@intrinsic
def _f16_fpext(typingctx: Any, h: Any) -> Any:
    """float16 bits (int16) to float32 by LLVM's ``fpext half``: one ``vcvtph2ps`` per 8 values on a
    CPU with F16C (used only there: elsewhere LLVM would call a runtime helper numba may not link)."""
    if h != types.int16:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


def _host_has_f16c() -> bool:
    try:
        from llvmlite import binding

        return bool(binding.get_host_cpu_features().get("f16c"))
    except Exception:  # noqa: BLE001 - no feature list: the portable decode
        return False


#: float16 words are decoded by the CPU's conversion instruction (F16C) where it has one
F16C = _host_has_f16c() and os.environ.get("OPBAND_NO_F16C") != "1"


def _f16_portable(h):  # type: ignore[no-untyped-def]
    """float16 bits (int16) to float32 with integer and float32 operations only (any CPU)."""
    raise NotImplementedError  # numba only


@overload(_f16_portable, inline="always")
def _f16_portable_impl(h):  # type: ignore[no-untyped-def]
    def f16(h):  # type: ignore[no-untyped-def]
        h = np.int32(h) & 0xFFFF
        em = h & 0x7FFF
        # normal and subnormal: the bits shifted into place, rebiased by a power-of-two product (exact)
        v = _bits_f32(np.int32(em << 13)) * np.float32(5.192296858534828e33)  # 2^112
        if em >= 0x7C00:  # Inf/NaN: the all-ones exponent
            v = _bits_f32(np.int32(0x7F800000 | ((em & 0x3FF) << 13)))
        return _bits_f32(np.int32(_f32_bits(v) | ((h & 0x8000) << 16)))
    return f16


@overload(_f16_to_f32, inline="always")
def _f16_impl(h):  # type: ignore[no-untyped-def]
    return (lambda h: _f16_fpext(h)) if F16C else (lambda h: _f16_portable(h))


@overload(_load32, inline="always")
def _load32_impl(x, i):  # type: ignore[no-untyped-def]
    dt = x.dtype
    if dt == types.float32:
        return lambda x, i: x[i]
    if dt == types.uint16:  # bfloat16: the upper half of a float32
        return lambda x, i: _bits_f32(np.int32(np.int32(x[i]) << 16))
    if dt == types.int16:
        return lambda x, i: _f16_to_f32(x[i])
    return None


@overload(_load, inline="always")
def _load_impl(x, i):  # type: ignore[no-untyped-def]
    if x.dtype == types.float64:
        return lambda x, i: x[i]
    return lambda x, i: np.float64(_load32(x, i))


def _pair(r, t, i):  # type: ignore[no-untyped-def]
    """Element ``i`` of both arrays in their work type: float32 when both are 16/32-bit, else float64."""
    raise NotImplementedError  # numba only


@overload(_pair, inline="always")
def _pair_impl(r, t, i):  # type: ignore[no-untyped-def]
    if r.dtype == types.float64 or t.dtype == types.float64:
        return lambda r, t, i: (_load(r, i), _load(t, i))
    return lambda r, t, i: (_load32(r, i), _load32(t, i))


def _bits(v):  # type: ignore[no-untyped-def]
    raise NotImplementedError  # numba only


@overload(_bits, inline="always")
def _bits_impl(v):  # type: ignore[no-untyped-def]
    return (lambda v: _f64_bits(v)) if v == types.float64 else (lambda v: _f32_bits(v))


def _unbits(b):  # type: ignore[no-untyped-def]
    raise NotImplementedError  # numba only


@overload(_unbits, inline="always")
def _unbits_impl(b):  # type: ignore[no-untyped-def]
    return (lambda b: _bits_f64(b)) if b == types.int64 else (lambda b: _bits_f32(b))


def _ordered(v):  # type: ignore[no-untyped-def]
    """The float's bits as an integer in the floats' order (integer min/max vectorize, float ones do not)."""
    raise NotImplementedError  # numba only


@overload(_ordered, inline="always")
def _ordered_impl(v):  # type: ignore[no-untyped-def]
    if v == types.float64:
        def o64(v):  # type: ignore[no-untyped-def]
            b = _f64_bits(v)
            return b ^ ((b >> 63) & 0x7FFFFFFFFFFFFFFF)
        return o64

    def o32(v):  # type: ignore[no-untyped-def]
        b = _f32_bits(v)
        return np.int32(b ^ ((b >> 31) & 0x7FFFFFFF))  # numba widens int32 arithmetic: narrow it back
    return o32


def _from_ordered(o):  # type: ignore[no-untyped-def]
    raise NotImplementedError  # numba only


@overload(_from_ordered, inline="always")
def _from_ordered_impl(o):  # type: ignore[no-untyped-def]
    if o == types.int64:
        return lambda o: _bits_f64(o ^ ((o >> 63) & 0x7FFFFFFFFFFFFFFF))
    return lambda o: _bits_f32(np.int32(o ^ ((o >> 31) & 0x7FFFFFFF)))


def _exp_scale(a):  # type: ignore[no-untyped-def]
    """2^-exponent of a positive normal ``a`` (1 / the power of two at or below it), in its type."""
    raise NotImplementedError  # numba only


@overload(_exp_scale, inline="always")
def _exp_scale_impl(a):  # type: ignore[no-untyped-def]
    if a == types.float64:  # a in [2^(E-1023), 2^(E-1022)) -> 2^(1023-E), kept normal for E = 2046
        return lambda a: _bits_f64((2047 - (_f64_bits(a) >> 52)) << 52) * 0.5
    return lambda a: _bits_f32(np.int32((255 - (_f32_bits(a) >> 23)) << 23)) * np.float32(0.5)


def _hcode(ad):  # type: ignore[no-untyped-def]
    """Histogram code of |error| ``ad``: 0 for zero, else 1 + (float32 bits >> HIST_SHIFT)."""
    raise NotImplementedError  # numba only


@overload(_hcode, inline="always")
def _hcode_impl(ad):  # type: ignore[no-untyped-def]
    def code(ad):  # type: ignore[no-untyped-def]
        b = _f32_bits(np.float32(ad))
        return (b >> HIST_SHIFT) + (b != 0)
    return code


def _like(v, x):  # type: ignore[no-untyped-def]
    """``x`` in the type of ``v``."""
    raise NotImplementedError  # numba only


@overload(_like, inline="always")
def _like_impl(v, x):  # type: ignore[no-untyped-def]
    return (lambda v, x: np.float64(x)) if v == types.float64 else (lambda v, x: np.float32(x))


def _is64(v):  # type: ignore[no-untyped-def]
    """Whether ``v`` is a float64 (a compile-time constant)."""
    raise NotImplementedError  # numba only


@overload(_is64, inline="always")
def _is64_impl(v):  # type: ignore[no-untyped-def]
    return (lambda v: True) if v == types.float64 else (lambda v: False)


def _nonfinite(v):  # type: ignore[no-untyped-def]
    """Whether ``v`` is NaN or Inf, from its bits (integer work: no fastmath rewrite reaches it)."""
    raise NotImplementedError  # numba only


@overload(_nonfinite, inline="always")
def _nonfinite_impl(v):  # type: ignore[no-untyped-def]
    if v == types.float64:
        return lambda v: (_f64_bits(v) & 0x7FF0000000000000) == 0x7FF0000000000000
    return lambda v: (_f32_bits(v) & 0x7F800000) == 0x7F800000


# -- statistics -------------------------------------------------------------------------------------
@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _sums64(xb: Any) -> Any:  # pragma: no cover - compiled
    """Sum and sum of squares of a block of finite values, in float64."""
    _wide()
    ds = dq = 0.0
    for i in range(xb.shape[0]):
        v = _load(xb, i)
        ds += v
        dq += v * v
    return ds, dq


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _masked64(xb: Any) -> Any:  # pragma: no cover - compiled
    """(sum, sumsq, min, max, nan, finite, zeros) of a block over its finite values, in float64,
    branch-free (selects; float counts vectorize)."""
    _wide()
    ds = dq = mn = mf = mz = 0.0
    ml, mh = _ordered(np.inf), _ordered(-np.inf)
    for i in range(xb.shape[0]):
        v = _load(xb, i)
        fin = v - v == 0.0
        w = v if fin else 0.0
        ds += w
        dq += w * w
        o = _ordered(v)
        ml = min(ml, o if fin else _ordered(np.inf))
        mh = max(mh, o if fin else _ordered(-np.inf))
        mn += 1.0 if v != v else 0.0
        mf += 1.0 if fin else 0.0
        mz += 1.0 if v == 0.0 else 0.0
    return ds, dq, _from_ordered(ml), _from_ordered(mh), int(mn), int(mf), int(mz)


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _stats_kernel(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """The statistics head (:data:`N_STATS`) of ``x`` into ``out``."""
    out[0], out[1] = np.inf, -np.inf
    out[2:] = 0.0
    _stats_more(x, out)


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _stats_more(x: Any, out: Any) -> None:  # pragma: no cover - compiled
    """Continue the head ``out`` over ``x``, the next elements of the same array: the result is the
    one pass over both would give when ``x`` starts on a STATS_BLOCK boundary.

    Block sums in the work type (float32 for 16/32-bit arrays, at most STATS_BLOCK elements), float64
    across blocks; min/max as ordered integers and the zero count as a float (both vectorize). A
    finite block whose float32 squares overflow (``finfo.min`` attention masks)
    redoes its two sums in float64; a block with NaN/Inf is redone masked, in float64. Both redo
    loops are branch-free (selects), so they vectorize too."""
    _wide()
    n = x.shape[0]
    lo, hi, s, q = out[0], out[1], out[2], out[3]
    nan, inf, zeros, count = int(out[4]), int(out[5]), int(out[6]), int(out[7])
    for b in range(0, n, STATS_BLOCK):
        e = min(b + STATS_BLOCK, n)
        xb = x[b:e]  # indices from 0: no negative-index wrap, so contiguous vector loads
        v0 = _pair(xb, xb, 0)[0]
        zero, one = _like(v0, 0.0), _like(v0, 1.0)
        bs = bq = bz = zero  # bz: the zero count in the work type (exact up to STATS_BLOCK), an integer one does not vectorize
        bl = bh = _ordered(v0)
        for i in range(e - b):
            v = _pair(xb, xb, i)[0]
            bs += v
            bq += v * v
            o = _ordered(v)
            bl = min(bl, o)
            bh = max(bh, o)
            bz += one if v == zero else zero
        if bs * zero == 0:  # NaN when the block holds NaN or Inf (or its float32 sum overflowed)
            if bq < np.inf:
                s += np.float64(bs)
                q += np.float64(bq)
            else:  # every value finite, but the float32 squares overflowed: the sums in float64
                ds, dq = _sums64(xb)
                s += ds
                q += dq
            lo = min(lo, np.float64(_from_ordered(bl)))
            hi = max(hi, np.float64(_from_ordered(bh)))
            zeros += int(bz)
            count += e - b
            continue
        ds, dq, ml, mh, mn, mf, mz = _masked64(xb)  # NaN/Inf in this block: float64, over the finite values
        s += ds
        q += dq
        if mf > 0:
            lo = min(lo, ml)
            hi = max(hi, mh)
        nan += mn
        inf += (e - b) - mf - mn
        zeros += mz
        count += mf
    out[0], out[1], out[2], out[3] = lo, hi, s, q
    out[4], out[5], out[6], out[7] = nan, inf, zeros, count


def tensor_stats(x: np.ndarray, threads: int = 1) -> np.ndarray:
    """``[lo, hi, sum, sumsq, nan, inf, zeros, finite]`` (float64) of a flat kernel array: min, max
    and the sums over the finite values, in one pass (two for blocks holding NaN/Inf). ``threads``
    > 1 splits large arrays."""
    out = np.empty(N_STATS, np.float64)
    parts = _parts(x.shape[0], threads, STATS_BLOCK)
    if len(parts) == 1:
        _stats_kernel(x, out)
        return out
    rows = np.empty((len(parts), N_STATS), np.float64)
    list(_pool().map(lambda p: _stats_kernel(x[p[1]:p[2]], rows[p[0]]), parts))
    out[0], out[1] = rows[:, 0].min(), rows[:, 1].max()
    out[2:] = rows[:, 2:].sum(axis=0)  # fixed order: the parts' order
    return out


#: :func:`stats_row` layout: these fields, then the sample (zero-padded to the row's length).
ROW_FIELDS = STAT_FIELDS
_N_ROW = len(ROW_FIELDS)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _finish_row(x: Any, idx: Any, head: Any, cancel: float, out: Any) -> None:  # pragma: no cover - compiled
    """The statistics row from :func:`_stats_kernel`'s ``head``: std from the two sums, or from a
    centred second pass when ``var <= cancel * mean^2`` (the one-pass form lost its digits)."""
    lo, hi, s, q = head[0], head[1], head[2], head[3]
    count = head[7]
    c = max(count, 1.0)
    mean = s / c
    var = max(q / c - mean * mean, 0.0)
    if count > 0 and var <= cancel * mean * mean:
        acc = 0.0
        for i in range(x.shape[0]):
            v = _load(x, i)
            if v - v == 0.0:  # finite
                acc += (v - mean) * (v - mean)
        var = acc / c
    out[0] = x.shape[0]
    out[1], out[2], out[3], out[4], out[5] = lo, hi, mean, np.sqrt(var), np.sqrt(q)
    out[6] = max(-lo, hi)
    out[7], out[8], out[9] = head[4], head[5], head[6]
    k = idx.shape[0]
    for j in range(k):
        out[_N_ROW + j] = _load(x, idx[j])
    for j in range(_N_ROW + k, out.shape[0]):
        out[j] = 0.0


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _row(x: Any, idx: Any, cancel: float, out: Any) -> None:  # pragma: no cover - compiled
    head = np.empty(N_STATS, np.float64)
    _stats_kernel(x, head)
    _finish_row(x, idx, head, cancel, out)


@intrinsic
def _voidptr(typingctx: Any, addr: Any) -> Any:
    """An integer address as a ``void*`` (for ``numba.carray``)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(addr), codegen


def _row_at(dtype: Any) -> Any:
    @numba.njit(nogil=True, cache=True)
    def row_at(addr: int, n: int, idx_addr: int, k: int, cancel: float, out: Any) -> None:  # pragma: no cover
        _row(numba.carray(_voidptr(addr), n, dtype), numba.carray(_voidptr(idx_addr), k, np.int64), cancel, out)

    return row_at


def _sample_at(dtype: Any) -> Any:
    @numba.njit(nogil=True, cache=True)
    def sample_at(addr: int, idx_addr: int, k: int, out: Any) -> None:  # pragma: no cover
        x = numba.carray(_voidptr(addr), 1, dtype)  # indexed past its declared length: no bounds checks
        idx = numba.carray(_voidptr(idx_addr), k, np.int64)
        for j in range(k):
            out[j] = _load(x, idx[j])

    return sample_at


def _more_at(dtype: Any) -> Any:
    @numba.njit(nogil=True, cache=True)
    def more_at(addr: int, n: int, out: Any) -> None:  # pragma: no cover
        _stats_more(numba.carray(_voidptr(addr), n, dtype), out)

    return more_at


#: ``MORE_AT[dtype](addr, n, head)``: continue a statistics head (``empty_head()``) over the ``n``
#: values at ``addr`` (the next part of an array, starting on a STATS_BLOCK boundary)
MORE_AT = {"float32": _more_at(np.float32), "float64": _more_at(np.float64),
           "bfloat16": _more_at(np.uint16), "float16": _more_at(np.int16)}


def empty_head() -> np.ndarray:
    """The statistics head of no values, for :data:`MORE_AT` to continue."""
    head = np.zeros(N_STATS, np.float64)
    head[0], head[1] = np.inf, -np.inf
    return head


@intrinsic
def _c_update(typingctx: Any, fn: Any, state: Any, data: Any, n: Any) -> Any:
    """``fn(state, data, n)``: the C function ``int fn(void*, const void*, size_t)`` at address ``fn``
    (a streaming hash's update), called from compiled code: the address is an argument, so the
    caller's machine code stays cacheable."""
    if not all(isinstance(a, types.Integer) for a in (fn, state, data, n)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ptr = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.IntType(32), [ptr, ptr, ir.IntType(64)])
        f, st, at, size = args
        return builder.call(builder.inttoptr(f, fnty.as_pointer()),
                            [builder.inttoptr(st, ptr), builder.inttoptr(at, ptr), size])

    return types.int32(fn, state, data, n), codegen


#: :func:`hashed_heads`' code of each kernel dtype
KIND_CODES = {"float32": 0, "float64": 1, "bfloat16": 2, "float16": 3}


@numba.njit(nogil=True, cache=True)
def _hashed_more(update: int, states: Any, addrs: Any, nbytes: Any, kinds: Any, heads: Any,
                 chunk: int) -> None:  # pragma: no cover - compiled
    for i in range(addrs.shape[0]):
        at, size, state, kind, head = addrs[i], nbytes[i], states[i], kinds[i], heads[i]
        for start in range(0, size, chunk):
            n = min(chunk, size - start)
            _c_update(update, state, at + start, n)  # the hash reads the chunk into the core's cache,
            if kind == 0:  # the statistics read it from there
                _stats_more(numba.carray(_voidptr(at + start), n // 4, np.float32), head)
            elif kind == 1:
                _stats_more(numba.carray(_voidptr(at + start), n // 8, np.float64), head)
            elif kind == 2:
                _stats_more(numba.carray(_voidptr(at + start), n // 2, np.uint16), head)
            else:
                _stats_more(numba.carray(_voidptr(at + start), n // 2, np.int16), head)


def hashed_heads(update: int, states: np.ndarray, addrs: np.ndarray, nbytes: np.ndarray, kinds: np.ndarray,
                 chunk: int) -> np.ndarray:
    """The statistics heads (``N_STATS`` columns) of several arrays given by address, byte size and
    :data:`KIND_CODES`, each read ``chunk`` bytes at a time, every chunk first handed to the C hash
    update ``update(states[i], chunk address, chunk bytes)``: a digest and the statistics of many
    tensors in one call that holds no GIL, each chunk read from memory once. ``chunk`` is a whole number
    of STATS_BLOCKs of float64, so each head is the one a single pass gives (:data:`MORE_AT`)."""
    assert chunk % (STATS_BLOCK * 8) == 0
    heads = np.zeros((addrs.shape[0], N_STATS), np.float64)
    heads[:, 0], heads[:, 1] = np.inf, -np.inf
    _hashed_more(update, states, addrs, nbytes, kinds, heads, chunk)
    return heads


#: ``SAMPLE_AT[dtype](addr, idx_addr, k, out)``: ``out[:k]`` = the values at flat indices ``idx``
SAMPLE_AT = {name: _sample_at(DTYPES[name].word.type) for name in KERNEL_DTYPES}
#: ``stats_row_at``'s function per dtype name of the values at the address
ROW_AT = {name: _row_at(DTYPES[name].word.type) for name in KERNEL_DTYPES}

def _row_cfunc(dtype: Any) -> Any:
    """``stats_row_at`` as a C function (numba ``cfunc``): hooks' compiled observer calls it by address,
    without Python, so its rows are this kernel's rows."""
    sig = types.void(types.intp, types.intp, types.intp, types.intp, types.float64, types.CPointer(types.float64),
                     types.intp)

    @numba.cfunc(sig, nopython=True, cache=True)
    def row_c(addr: int, n: int, idx_addr: int, k: int, cancel: float, out: Any, length: int) -> None:  # pragma: no cover
        _row(numba.carray(_voidptr(addr), n, dtype), numba.carray(_voidptr(idx_addr), k, np.int64), cancel,
             numba.carray(out, length))

    return row_c


_ROW_CFUNCS: dict[str, Any] = {}


def row_cfunc_addresses() -> list[int]:
    """The C addresses of the statistics row for each of :data:`~accuracy.capture_format.KERNEL_DTYPES`
    (in that order, the kernel codes): ``void row(values, n, sample_index, k, cancel, double* out,
    out_length)``, compiled (or loaded from numba's cache) at the first call."""
    if not _ROW_CFUNCS:
        _ROW_CFUNCS.update({name: _row_cfunc(DTYPES[name].word.type) for name in KERNEL_DTYPES})
    return [_ROW_CFUNCS[name].address for name in KERNEL_DTYPES]


#: ``var <= CANCEL * mean^2``: the one-pass variance has lost most of its digits (~1e4 ulp of the work type)
CANCEL = {"float32": 1e4 * 2.0**-23, "bfloat16": 1e4 * 2.0**-23, "float16": 1e4 * 2.0**-23, "float64": 1e4 * 2.0**-52}


def stats_row(x: np.ndarray, idx: np.ndarray, dtype: str, length: int, threads: int = 1) -> np.ndarray:
    """The statistics row (:data:`ROW_FIELDS`, then ``x[idx]`` zero-padded to ``length``) of a flat
    kernel array whose values are of ``dtype`` (``float32``, ``float64``, ``bfloat16``, ``float16``)."""
    out = np.empty(length, np.float64)
    if threads > 1 and x.shape[0] >= PARALLEL_MIN:
        _finish_row(x, idx, tensor_stats(x, threads), CANCEL[dtype], out)
    else:
        _row(x, idx, CANCEL[dtype], out)
    return out


# -- error distribution -----------------------------------------------------------------------------
_SQ_UNDERFLOW = 2.0**-100  # a float32 block's sum of r^2 in (0, this): squares near float32's tiny
_ERR_UNDERFLOW = 2.0**-60  # a float32 block's largest |t - r| in (0, this): its square underflows
_F32_SAFE = 2.0**127  # a block's sums at or beyond this (or inf) overflow float32 work


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _element_errors(rv: Any, tv: Any, guard: Any, tiny: Any) -> Any:  # pragma: no cover - compiled
    """One element's error in the type of its values: ``t - r``, ``|t - r|``, the relative error
    (``|r|`` floored at ``guard``) and the ULP distance scaled by 2^-mantissa (``|r|`` floored at ``tiny``)."""
    d = tv - rv
    ad = abs(d)
    ar = abs(rv)
    return d, ad, ad / max(ar, guard), ad * _exp_scale(max(ar, tiny))


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy", inline="always")
def _error_block(rb: Any, tb: Any, zero: Any, guard: Any, tiny: Any, one: Any, th0: Any, th1: Any, th2: Any,
                 codes: Any) -> Any:  # pragma: no cover - compiled
    """One block's error sums and counts, branch-free, worked in the type of ``zero`` (the parameters
    are in it too); ``codes[i]``: each element's histogram code. Returns the sums (abs, err, sq,
    ref^2, d*r, rel, ulp), the maxima's bits (abs, rel, ulp), the counts (over 1 ulp, over each
    threshold) and ``bad``, the count of elements whose difference is NaN or Inf: a NaN or Inf on
    either side, or two finite values whose difference overflows the work type.

    ``bad`` is counted on the bits (exponent all ones): a float test such as ``r * 0 + t * 0`` is NaN
    for NaN/Inf, but fastmath's reassociation may factor it into ``(r + t) * 0``, NaN for two finite
    values whose sum overflows (``finfo.min`` masks), which would send such blocks element by element."""
    ba = be = bq = br = bd = brel = bu = zero
    ma = mr = mu = _bits(zero)  # bits of non-negative values: integer maxima vectorize
    # the counts in the work type too (exact: a block is far below 2^24 elements): int64 counts beside
    # float32 lanes make LLVM pick 4-wide vectors and spill on AVX2
    bo = c0 = c1 = c2 = bad = zero
    for i in range(rb.shape[0]):
        rv, tv = _pair(rb, tb, i)
        rv, tv = _like(zero, rv), _like(zero, tv)  # exact: the work type is at least as wide
        d, ad, rel, ulps = _element_errors(rv, tv, guard, tiny)
        bad += _like(zero, _nonfinite(d))  # NaN/Inf on either side, or a difference beyond the work type
        be += d
        ba += ad
        bq += d * d
        br += rv * rv
        bd += d * rv
        brel += rel
        bu += ulps
        ma = max(ma, _bits(ad))
        mr = max(mr, _bits(rel))
        mu = max(mu, _bits(ulps))
        bo += _like(zero, ulps > one)
        c0 += _like(zero, rel > th0)
        c1 += _like(zero, rel > th1)
        c2 += _like(zero, rel > th2)
        codes[i] = _hcode(ad)
    return ba, be, bq, br, bd, brel, bu, ma, mr, mu, int(bo), int(c0), int(c1), int(c2), int(bad)


@numba.njit(nogil=True, cache=True, inline="always")
def _fits_float32(block: Any) -> bool:  # pragma: no cover - compiled
    """An :func:`_error_block` result's sums fit float32 work: no overflow, no squares near float32's underflow."""
    total = block[2] + block[3] + block[5] + block[6]
    return (total < _F32_SAFE and not 0 < block[3] < _SQ_UNDERFLOW
            and not 0 < np.float64(_unbits(block[7])) < _ERR_UNDERFLOW)


@numba.njit(nogil=True, cache=True, inline="always")
def _widened(block: Any) -> Any:  # pragma: no cover - compiled
    """An :func:`_error_block` result in one type whatever the work type: float64 sums and maxima, int counts."""
    return (np.float64(block[0]), np.float64(block[1]), np.float64(block[2]), np.float64(block[3]),
            np.float64(block[4]), np.float64(block[5]), np.float64(block[6]), np.float64(_unbits(block[7])),
            np.float64(_unbits(block[8])), np.float64(_unbits(block[9])), np.int64(block[10]), np.int64(block[11]),
            np.int64(block[12]), np.int64(block[13]))


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _error_kernel(r: Any, t: Any, guard: float, tiny: float, one_ulp: float, th0: float, th1: float, th2: float,
                  acc: Any, hist: Any) -> None:  # pragma: no cover - compiled
    """Add the errors of ``t`` against ``r`` to ``acc`` (see :data:`ACC_FIELDS`; ULP distances are
    scaled by 2^-mantissa bits, ``one_ulp``) and ``hist`` (counts by :func:`_hcode`).

    Element work is done in the pair's work type (float32 when both arrays are 16/32-bit: a float32
    difference is correctly rounded, as the float64 one rounded to float32 would be), block sums
    likewise over at most BLOCK elements, float64 across blocks. A finite block with a float32
    overflow (``finfo.min`` attention masks) or with squares near float32's underflow is redone in
    float64, still vectorized; a block with NaN/Inf is redone element by element in float64.
    """
    _wide()
    n = r.shape[0]
    if n == 0:
        return
    codes = np.empty(BLOCK, np.int32)
    sub = np.zeros((4, N_CODES), np.int64)  # four interleaved histograms: no store-forwarding stalls
    s_abs = s_err = s_sq = s_ref = s_dr = s_rel = s_ulp = 0.0
    m_abs = m_rel = m_ulp = 0.0
    over_ulp = o0 = o1 = o2 = 0
    finite = exact = nan_mm = inf_mm = nan_rf = 0
    zero = _like(_pair(r, t, 0)[0], 0.0)
    guard_w = _like(zero, max(guard, 2.0**-126))
    tiny_w = _like(zero, max(tiny, 2.0**-126))
    one_w = _like(zero, one_ulp)
    th0_w, th1_w, th2_w = _like(zero, th0), _like(zero, th1), _like(zero, th2)
    wide = False  # the last block was beyond float32's range: try float64 first
    bad = 0
    for b in range(0, n, BLOCK):
        e = min(b + BLOCK, n)
        rb, tb = r[b:e], t[b:e]  # indices from 0: no negative-index wrap, so contiguous vector loads
        ok = False
        if not wide:
            block = _error_block(rb, tb, zero, guard_w, tiny_w, one_w, th0_w, th1_w, th2_w, codes)
            bad = block[14]
            ok = bad == 0 and (_is64(zero) or _fits_float32(block))
            if ok:
                sums = _widened(block)
        if not ok and (wide or bad == 0):  # finite, but beyond float32's range: the same loop in float64
            block64 = _error_block(rb, tb, 0.0, guard, tiny, one_ulp, th0, th1, th2, codes)
            ok = block64[14] == 0
            if ok:
                sums = _widened(block64)
            # a mask's rows go on past this block: start the next in float64 (either type is exact enough)
            wide = ok and not _fits_float32(block64)
        if ok:
            s_abs += sums[0]
            s_err += sums[1]
            s_sq += sums[2]
            s_ref += sums[3]
            s_dr += sums[4]
            s_rel += sums[5]
            s_ulp += sums[6]
            m_abs = max(m_abs, sums[7])
            m_rel = max(m_rel, sums[8])
            m_ulp = max(m_ulp, sums[9])
            over_ulp += sums[10]
            o0 += sums[11]
            o1 += sums[12]
            o2 += sums[13]
            finite += e - b
            m = e - b
            j = 0
            while j + 4 <= m:
                sub[0, codes[j]] += 1
                sub[1, codes[j + 1]] += 1
                sub[2, codes[j + 2]] += 1
                sub[3, codes[j + 3]] += 1
                j += 4
            while j < m:
                sub[0, codes[j]] += 1
                j += 1
            continue
        for i in range(b, e):  # float64, element by element, with NaN/Inf bookkeeping
            rv = _load(r, i)
            tv = _load(t, i)
            rn, tn = rv != rv, tv != tv
            ri = rv == np.inf or rv == -np.inf
            ti = tv == np.inf or tv == -np.inf
            nan_mm += rn != tn
            nan_rf += tn and not rn and not ri
            inf_mm += (ri != ti) or (ri and ti and rv != tv)
            if rn or tn or ri or ti:
                exact += (rn and tn) or rv == tv
                continue
            finite += 1
            d, ad, rel, ulps = _element_errors(rv, tv, guard, tiny)
            s_err += d
            s_abs += ad
            s_sq += d * d
            s_ref += rv * rv
            s_dr += d * rv
            s_rel += rel
            s_ulp += ulps
            m_abs = max(m_abs, ad)
            m_rel = max(m_rel, rel)
            m_ulp = max(m_ulp, ulps)
            over_ulp += ulps > one_ulp
            o0 += rel > th0
            o1 += rel > th1
            o2 += rel > th2
            sub[0, _hcode(ad)] += 1
    acc[0] += n
    acc[1] += finite
    acc[2] += exact
    acc[3] += nan_mm
    acc[4] += inf_mm
    acc[5] += nan_rf
    acc[6] += s_abs
    acc[7] += s_err
    acc[8] += s_sq
    acc[9] += s_ref
    acc[10] += s_dr
    acc[11] += s_rel
    acc[12] += s_ulp
    acc[13] = max(acc[13], m_abs)
    acc[14] = max(acc[14], m_rel)
    acc[15] = max(acc[15], m_ulp)
    acc[16] += over_ulp
    acc[17] += o0
    acc[18] += o1
    acc[19] += o2
    for c in range(N_CODES):
        hist[c] += sub[0, c] + sub[1, c] + sub[2, c] + sub[3, c]


@numba.njit(nogil=True, cache=True)
def public_histogram(codes: Any, low: int, high: int, ranks: Any, bounds: Any, hist: Any,
                     quantiles: Any) -> int:  # pragma: no cover - compiled
    """Fold the kernel's histogram ``codes`` into ``hist``: slot 0 exact zeros (code 0), slot 1 everything
    below code ``low``, then codes ``low..high-1`` one slot each, the last slot everything from ``high`` on.
    ``quantiles``: its :func:`histogram_quantiles` at ``ranks``. Returns the total."""
    last = hist.shape[0] - 1
    hist[0] = codes[0]
    below = 0
    for c in range(1, low):
        below += codes[c]
    hist[1] = below
    for c in range(low, high):
        hist[2 + c - low] = codes[c]
    above = 0
    for c in range(high, codes.shape[0]):
        above += codes[c]
    hist[last] = above
    total = 0
    for i in range(last + 1):
        total += hist[i]
    histogram_quantiles(hist, total, ranks, bounds, quantiles)
    return total


@numba.njit(nogil=True, cache=True)
def histogram_quantiles(hist: Any, total: int, ranks: Any, bounds: Any, quantiles: Any) -> None:  # pragma: no cover
    """``quantiles[j]``: the ``ranks[j]`` quantile of a public histogram of ``total`` counts, in the first
    slot whose cumulative count reaches that fraction (``np.searchsorted(cumsum(hist), rank, "left")``),
    interpolated geometrically between the slot's ``bounds`` (0 in slot 0; the open slots 1 and last
    give their one finite bound); all 0 when the histogram is empty."""
    last = hist.shape[0] - 1
    for j in range(ranks.shape[0]):
        quantiles[j] = 0.0
        if total == 0:
            continue
        rank = ranks[j] * total
        running = 0
        idx, before = last, total - hist[last]
        for i in range(last + 1):
            if running + hist[i] >= rank:
                idx, before = i, running
                break
            running += hist[i]
        lo, hi = bounds[idx, 0], bounds[idx, 1]
        if idx == last:
            quantiles[j] = lo
        elif idx == 1:
            quantiles[j] = hi
        elif idx > 1:
            frac = min(max((rank - before) / max(hist[idx], 1), 0.0), 1.0)
            quantiles[j] = lo * (hi / lo) ** frac


#: :func:`error_summary`'s ``out`` fields, in :class:`accuracy.metrics.Metrics` field order
SUMMARY_FIELDS = ("max_abs", "mean_abs", "rmse", "max_rel", "mean_rel", "cosine", "snr_db", "norm_l2", "ulp_max",
                  "ulp_mean", "share_over_1ulp", "rel_over_0", "rel_over_1", "rel_over_2", "error_balance",
                  "nan_mismatch", "inf_mismatch", "nan_where_ref_finite", "exact_share")
assert ACC_FIELDS[:20] == ("numel", "finite", "exact", "nan_mismatch", "inf_mismatch", "nan_where_ref_finite", "sum_abs",
                          "sum_err", "sum_sq_err", "sum_sq_ref", "dot_dr", "sum_rel", "sum_ulp", "max_abs", "max_rel",
                          "ulp_max", "over_ulp", "rel_over_0", "rel_over_1", "rel_over_2"), "error_summary reads these by position"


@numba.njit(nogil=True, cache=True)
def error_summary(acc: Any, codes: Any, low: int, high: int, ranks: Any, bounds: Any, ulp_scale: float, hist: Any,
                  quantiles: Any, out: Any) -> None:  # pragma: no cover - compiled
    """An accumulator's metrics in one call: :func:`public_histogram` into ``hist`` and ``quantiles``, and
    :data:`SUMMARY_FIELDS` into ``out``, by the same IEEE operations, in the same order, as Python's
    arithmetic on the accumulator's fields (no fastmath here: the results are those numbers exactly).
    ``acc`` must count at least one element."""
    public_histogram(codes, low, high, ranks, bounds, hist, quantiles)
    n = acc[0]
    f = max(np.float64(np.int64(acc[1])), 1.0)
    sum_abs, sum_err, sum_sq_err, sum_sq_ref, dot_dr = acc[6], acc[7], acc[8], acc[9], acc[10]
    out[0] = acc[13]
    out[1] = sum_abs / f
    out[2] = np.sqrt(sum_sq_err / f)
    out[3] = acc[14]
    out[4] = acc[11] / f
    out[5] = _cosine(sum_sq_ref, sum_sq_err, dot_dr)
    if sum_sq_err > 0 and sum_sq_ref > 0:
        out[6] = 10 * np.log10(sum_sq_ref / sum_sq_err)
    else:
        out[6] = np.inf if sum_sq_err == 0 else -np.inf
    if sum_sq_ref > 0:
        out[7] = np.sqrt(sum_sq_err / sum_sq_ref)
    else:
        out[7] = 0.0 if sum_sq_err == 0 else np.inf
    out[8] = acc[15] * ulp_scale
    out[9] = acc[12] * ulp_scale / f
    out[10] = acc[16] / f
    out[11] = acc[17] / f
    out[12] = acc[18] / f
    out[13] = acc[19] / f
    out[14] = sum_err / sum_abs if sum_abs > 0 else 0.0
    out[15] = acc[3]
    out[16] = acc[4]
    out[17] = acc[5]
    out[18] = (acc[2] + hist[0]) / n


@numba.njit(nogil=True, cache=True)
def _cosine(rr: float, dd: float, dr: float) -> float:  # pragma: no cover - compiled
    """cos(r, t) from |r|^2, |d|^2 and d.r (t = r + d), accurate when it is close to 1 (``min``/``max``
    as Python's: a NaN stays out of the clamp, as there)."""
    tt = rr + 2 * dr + dd
    if rr <= 0 or tt <= 0:
        return 1.0 if dd == 0 else 0.0
    nr, nt = np.sqrt(rr), np.sqrt(tt if tt > 0.0 else 0.0)
    diff = -(2 * dr + dd) / (nr + nt)
    one_minus = (dd - diff * diff) / (2 * nr * nt)
    c = 1.0 - one_minus
    c = c if c < 1.0 else 1.0
    return c if c > -1.0 else -1.0


@numba.njit(nogil=True, cache=True, fastmath=_FASTMATH, error_model="numpy")
def _clip_kernel(x: Any, top: float, out: Any) -> None:  # pragma: no cover - compiled
    """``out[i]``: ``x[i]`` decoded and clamped to ``[-top, top]`` (Inf too; NaN stays NaN), in ``out``'s type."""
    _wide()
    hi = _like(out[0], top)
    for i in range(x.shape[0]):
        v = _like(hi, _load(x, i))
        out[i] = -hi if v < -hi else hi if v > hi else v


#: clamp buffers up to this many bytes a side are kept per thread (fresh ones cost a page fault per 4 KB)
_KEEP_CLIP_BYTES = 8 << 20
_CLIP_BUFFERS = threading.local()


def clip_buffers(n: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """Two work arrays of ``n`` elements of ``dtype`` for :func:`clipped`, reused by this thread's next
    call when at most :data:`_KEEP_CLIP_BYTES` each (so the kernel's input is never copied into fresh pages)."""
    dtype = np.dtype(dtype)
    nbytes = n * dtype.itemsize
    if nbytes > _KEEP_CLIP_BYTES:
        return np.empty(n, dtype), np.empty(n, dtype)
    kept = getattr(_CLIP_BUFFERS, "pair", None)
    if kept is None or kept[0].nbytes < nbytes:
        size = max(nbytes, 1 << 16)
        kept = _CLIP_BUFFERS.pair = (np.empty(size, np.uint8), np.empty(size, np.uint8))
    return kept[0][:nbytes].view(dtype), kept[1][:nbytes].view(dtype)


def clipped(x: np.ndarray, top: float, out: np.ndarray) -> np.ndarray:
    """A flat kernel array's values clamped to ``[-top, top]`` (Inf too, NaN stays NaN) into ``out[:len(x)]``
    (float32 or float64, the type they are compared in), in one pass; returns that slice."""
    view = out[: x.shape[0]]
    if x.shape[0]:
        _clip_kernel(x, float(top), view)
    return view


@numba.njit(nogil=True, cache=True)
def batch_summary(r: Any, roffs: Any, t: Any, toffs: Any, counts: Any, guards: Any, tiny: float, one_ulp: float,
                  th0: float, th1: float, th2: float, acc: Any, codes: Any, low: int, high: int, ranks: Any, bounds: Any,
                  ulp_scale: float, hists: Any, quantiles: Any, outs: Any, ns: Any) -> None:  # pragma: no cover - compiled
    """Many pairs' metrics in one call. Pair ``p`` is ``r[roffs[p]:roffs[p] + counts[p]]`` against the
    slice of ``t`` at ``toffs[p]``, with ``guards[p]``; for each, ``acc`` and ``codes`` (scratch) are
    zeroed, the pair added by :func:`_error_kernel`, and when it counted any element :func:`error_summary`
    fills row ``p`` of ``hists``, ``quantiles`` and ``outs``; ``ns[p]`` is its element count. What
    :class:`ErrorAccumulator` and ``error_summary`` do for a pair below PARALLEL_MIN (one part), without
    two dispatches per pair and the accumulator's allocations."""
    for p in range(counts.shape[0]):
        n = counts[p]
        acc[:] = 0.0
        codes[:] = 0
        _error_kernel(r[roffs[p]:roffs[p] + n], t[toffs[p]:toffs[p] + n], guards[p], tiny, one_ulp, th0, th1, th2,
                      acc, codes)
        ns[p] = acc[0]
        if acc[0] > 0:
            error_summary(acc, codes, low, high, ranks, bounds, ulp_scale, hists[p], quantiles[p], outs[p])


@numba.njit(nogil=True, cache=True)
def gather_bytes(buf: Any, begins: Any, sizes: Any, slots: Any, out: Any) -> None:  # pragma: no cover - compiled
    """Copy ``buf[begins[p]:begins[p] + sizes[p]]`` to ``out[slots[p]:]`` for every ``p`` (tensors spread over
    a mapped file, packed into one aligned array for :func:`batch_summary`)."""
    for p in range(begins.shape[0]):
        out[slots[p]:slots[p] + sizes[p]] = buf[begins[p]:begins[p] + sizes[p]]


def error_args(guard: float, tiny: float, mant: int, thresholds: tuple[float, float, float]) -> tuple[float, ...]:
    """:func:`_error_kernel`'s scalars after its arrays: guard, tiny, one ULP (2^-mant), the thresholds."""
    return (float(guard), float(tiny), float(2.0**-mant), *map(float, thresholds))


class ErrorAccumulator:
    """Running error sums, maxima, counts and histogram codes of one pair, fed chunk by chunk.

    ``guard``: the floor of ``|r|`` in relative errors; ``tiny``, ``mant``: the target dtype's
    smallest normal and mantissa bits (ULP distances); ``thresholds``: the three relative-error
    levels whose exceedances are counted."""

    def __init__(self, guard: float, tiny: float, mant: int, thresholds: tuple[float, float, float]) -> None:
        self.acc = np.zeros(len(ACC_FIELDS), np.float64)
        self.hist = np.zeros(N_CODES, np.int64)
        self.mant = mant  # ULP sums and maxima are kept scaled by 2^-mant
        self.args = error_args(guard, tiny, mant, thresholds)

    def add(self, r: np.ndarray, t: np.ndarray, threads: int = 1) -> None:
        """Add a pair of equally long flat kernel arrays."""
        parts = _parts(r.shape[0], threads)
        if len(parts) == 1:
            _error_kernel(r, t, *self.args, self.acc, self.hist)
            return
        accs = np.zeros((len(parts), len(ACC_FIELDS)), np.float64)
        hists = np.zeros((len(parts), N_CODES), np.int64)
        list(_pool().map(lambda p: _error_kernel(r[p[1]:p[2]], t[p[1]:p[2]], *self.args, accs[p[0]], hists[p[0]]),
                         parts))
        for row, h in zip(accs, hists, strict=True):  # fixed order: the parts' order
            maxima = np.maximum(self.acc[list(_MAX_FIELDS)], row[list(_MAX_FIELDS)])
            self.acc += row
            self.acc[list(_MAX_FIELDS)] = maxima
            self.hist += h

    def get(self, name: str) -> float:
        return float(self.acc[A[name]])


# -- encodings and threads --------------------------------------------------------------------------
#: the 16-bit formats, whose kernels read raw words, by record name and bundle tag
_WORDS = {key: d.word for d in DTYPES.values() if d.word is not None and d.word.itemsize == 2 for key in (d.name, d.tag)}


def kernel_array(x: np.ndarray, dtype: str | None = None) -> np.ndarray | None:
    """A flat contiguous view of ``x`` in a kernel encoding, or None when it has none (FP8, ints).

    ``dtype``: the values' dtype name when ``x`` holds raw words (``bfloat16``/``BF16`` as uint16
    or int16 words); numpy float16 arrays are viewed as their int16 words."""
    flat = x.reshape(-1)
    if dtype in _WORDS:
        return np.ascontiguousarray(flat).view(_WORDS[dtype])
    if flat.dtype == np.float16:
        return np.ascontiguousarray(flat).view(np.int16)
    if flat.dtype in (np.float32, np.float64):
        return np.ascontiguousarray(flat)
    return None


@functools.cache
def default_threads() -> int:
    """Threads for large arrays: the CPUs this process may run on (at start), at most 8."""
    try:
        return max(1, min(len(os.sched_getaffinity(0)), 8))
    except AttributeError:  # not on Linux
        return max(1, min(os.cpu_count() or 1, 8))


def _parts(n: int, threads: int, align: int = BLOCK) -> list[tuple[int, int, int]]:
    """(index, start, stop) of each thread's part: ``align``-aligned (the kernel's block), one part
    below PARALLEL_MIN."""
    k = max(1, min(threads, n // (PARALLEL_MIN // 2))) if n >= PARALLEL_MIN else 1
    if k == 1:
        return [(0, 0, n)]
    step = -(-n // k)
    step = -(-step // align) * align
    return [(i, s, min(s + step, n)) for i, s in enumerate(range(0, n, step))]


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        with _POOL_LOCK:
            if _POOL is None:
                _POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="opband-fused")
    return _POOL


def warm_up(errors: bool = False) -> None:
    """Compile (or load from numba's cache) the statistics kernels for every encoding, and with
    ``errors`` the error kernel (alone and in :func:`batch_summary`) for same-typed pairs and for a float32
    reference against bfloat16 and float16 words (a low-precision port), in memory and, for the 16/32-bit
    ones, read in place from mapped bundles, and the clamp and the byte gather, outside a hot loop (other
    combinations, e.g. float64 read in place, compile at first use). Once per process and kind:
    every capture calls it, and after the first the kernels are loaded."""
    if errors in _WARM:
        return
    idx = np.zeros(1, np.int64)
    out = np.empty(_N_ROW + 1)
    for fn in ROW_AT.values():
        fn(idx.ctypes.data, 1, idx.ctypes.data, 1, 0.0, out)
    for fn in SAMPLE_AT.values():
        fn(idx.ctypes.data, idx.ctypes.data, 1, out)
    for fn in MORE_AT.values():
        fn(idx.ctypes.data, 1, empty_head())
    nothing = np.zeros(0, np.int64)  # no arrays: compiles the hashed walk, calls no hash
    hashed_heads(0, nothing, nothing, nothing, nothing, STATS_BLOCK * 8)
    if errors:
        public_histogram(np.zeros(N_CODES, np.int64), 1, 2, np.zeros(1), np.ones((4, 2)), np.zeros(4, np.int64), np.zeros(1))
        acc = ErrorAccumulator(2.0**-126, 2.0**-126, 23, (1e-4, 1e-3, 5e-3))
        acc.acc[0] = 1.0
        error_summary(acc.acc, acc.hist, 1, 2, np.zeros(1), np.ones((4, 2)), 1.0, np.zeros(4, np.int64), np.zeros(1),
                      np.zeros(len(SUMMARY_FIELDS)))
        acc.acc[0] = 0.0
        nil = np.zeros(1, np.int64)  # offset 0, count 0: compiles the call, measures nothing
        scratch = (np.zeros(len(ACC_FIELDS)), np.zeros(N_CODES, np.int64), 1, 2, np.zeros(1), np.ones((4, 2)), 1.0,
                   np.zeros((1, 4), np.int64), np.zeros((1, 1)), np.zeros((1, len(SUMMARY_FIELDS))), np.zeros(1))
        for dt in (np.float32, np.float64, np.uint16, np.int16):
            z = np.zeros(1, dt)
            acc.add(z, z)
            batch_summary(z, nil, z, nil, nil, np.ones(1), *acc.args[1:], *scratch)
            clipped(z, 1.0, np.zeros(1, np.float32 if dt != np.float64 else np.float64))
        for dt in (np.uint16, np.int16):
            acc.add(np.zeros(1, np.float32), np.zeros(1, dt))
            batch_summary(np.zeros(1, np.float32), nil, np.zeros(1, dt), nil, nil, np.ones(1), *acc.args[1:], *scratch)
        for rt, tt in ((np.float32, np.float32), (np.float32, np.uint16), (np.float32, np.int16), (np.uint16, np.uint16),
                       (np.int16, np.int16)):  # a comparison reads the pairs where they lie in the mapped bundles
            r, t = np.zeros(1, rt), np.zeros(1, tt)
            r.flags.writeable = t.flags.writeable = False
            batch_summary(r, nil, t, nil, nil, np.ones(1), *acc.args[1:], *scratch)
        u8 = np.zeros(8, np.uint8)
        gather_bytes(u8, nil, nil, nil, u8)
        gather_bytes(np.frombuffer(bytes(8), np.uint8), nil, nil, nil, u8)  # a mapped (read-only) bundle
    _WARM.add(errors)


_WARM: set[bool] = set()  # the kinds warm_up has loaded in this process
