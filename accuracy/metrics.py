"""Error distributions between a reference and a target tensor, in one chunked pass.

One pass over aligned chunks of ``CHUNK`` elements (32 Ki, so a chunk's temporaries stay in
cache); every sum is carried across chunks in float64. Two kernels share the accumulator:

- ``_fast_chunk``: both chunks float32 (BF16/F16/F8 decode to float32 exactly) and every value
  finite. Element work is done in float32 into reused buffers; per-chunk sums are BLAS dot
  products (the four plain sums as one matrix-vector product) with float32 accumulation over at
  most 32 Ki elements (relative error ~1e-6, far below the 3 digits the reports show) and are
  summed across chunks in float64. Cosine is derived from ``d = t - r``
  (``1 - cos = (|d|^2 - (|r| - |t|)^2) / (2 |r| |t|)``), so it keeps its accuracy when it is
  1 - 1e-12. ULP distances use the float32 exponent bits, not ``np.frexp``. The histogram is
  exact: ``np.bincount`` of the float32 bits of ``|d|`` shifted right by 21. The maximum error is
  taken first: NaN/Inf send the chunk to the float64 kernel before any other work, and an exact
  chunk (every error zero) costs one more dot product.
- ``_exact_chunk``: anything else (a float64 golden, NaN/Inf, values that overflow float32
  squares): float64 element work, NaN/Inf bookkeeping, the same definitions.

Definitions (``r`` reference, ``t`` target, over elements where both are finite):

- relative error ``|t - r| / max(|r|, guard)``, ``guard = eps(target dtype) * absmax(r)`` when the
  reference's absmax is known up front (recorded statistics), else the smallest normal of the
  target dtype: without it a reference element of 1e-30 turns rounding into astronomic errors.
- ULP distance ``|t - r| / ulp(r)`` with ``ulp(r) = 2^(exponent(max(|r|, tiny)) - mantissa bits)``
  of the *target* dtype, so a bf16 target is measured in bf16 ulps.
- quantiles of ``|t - r|`` come from the fixed histogram: slot 0 counts exact zeros, slot 1
  errors below ``2^-40``, then quarter-octave bins (4 per power of two: the float32 exponent and
  top two mantissa bits) up to ``2^16``, and the last slot errors of ``2^16`` or more. A quantile
  is interpolated geometrically inside its bin (resolution error at most a factor 1.25).
- NaN/Inf: ``nan_mismatch`` counts elements where exactly one side is NaN,
  ``nan_where_ref_finite`` those where the target is NaN and the reference finite, and
  ``inf_mismatch`` those whose infinities differ (presence or sign). Equal non-finite values
  count as exact; the other statistics cover only elements finite on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

REL_THRESHOLDS = (1e-4, 1e-3, 5e-3)
QUANTILES = (0.5, 0.9, 0.99, 0.999)
CHUNK = 1 << 15

#: Histogram geometry (see the module docstring): quarter-octave bins of |error|.
HIST_PER_OCTAVE = 4
HIST_LOW_EXP, HIST_HIGH_EXP = -40, 16
_N_BINS = (HIST_HIGH_EXP - HIST_LOW_EXP) * HIST_PER_OCTAVE
HIST_SLOTS = _N_BINS + 3
#: Lower edges of the regular bins (slot 2 + i covers ``[HIST_EDGES[i], HIST_EDGES[i + 1])``).
HIST_EDGES = np.array(
    [2.0 ** (HIST_LOW_EXP + i // HIST_PER_OCTAVE) * (1 + (i % HIST_PER_OCTAVE) / HIST_PER_OCTAVE) for i in range(_N_BINS)]
    + [2.0**HIST_HIGH_EXP]
)
_SHIFT = 23 - 2  # float32 bits >> 21 = exponent * 4 + top two mantissa bits
_FINE_LOW = (HIST_LOW_EXP + 127) * HIST_PER_OCTAVE
_FINE_HIGH = (HIST_HIGH_EXP + 127) * HIST_PER_OCTAVE
_FINE_SLOTS = 1 << (31 - _SHIFT)

#: Mantissa bits (excluding the implicit one) and smallest normal of each floating dtype.
FLOAT_FORMATS: dict[str, tuple[int, float]] = {
    "float64": (52, 2.0**-1022),
    "float32": (23, 2.0**-126),
    "tfloat32": (10, 2.0**-126),
    "float16": (10, 2.0**-14),
    "bfloat16": (7, 2.0**-126),
    "float8_e4m3fn": (3, 2.0**-6),
    "float8_e5m2": (2, 2.0**-14),
}
INT_DTYPES = ("int8", "qint8", "quint8", "int16", "int32", "int64", "uint8", "bool", "qint32")


def machine_eps(dtype: str) -> float:
    """Unit roundoff (half an ulp at 1.0) of a float dtype name; int8 (int4) uses half its 1/127 (1/15) step."""
    if dtype in FLOAT_FORMATS:
        return 2.0 ** -(FLOAT_FORMATS[dtype][0] + 1)
    if dtype in ("int8", "qint8", "quint8"):
        return 1.0 / 254.0
    if dtype == "int4":
        return 1.0 / 30.0
    return 0.0


def is_float_dtype(dtype: str) -> bool:
    return dtype in FLOAT_FORMATS or dtype.startswith("complex")


@dataclass
class Metrics:
    """The error distribution of one (reference, target) pair. Truthy when values are equal.

    ``source`` says what the numbers were computed from: ``tensor`` (every element) or
    ``summary`` (a summary bundle: the recorded element sample plus statistics deltas, where
    ``norm_l2``/``max_abs`` are the larger of the sample estimate and the provable lower bound
    the statistics give; see :func:`compare_stats`).
    """

    numel: int
    max_abs: float = 0.0
    mean_abs: float = 0.0
    rmse: float = 0.0
    max_rel: float = 0.0
    mean_rel: float = 0.0
    cosine: float = 1.0
    snr_db: float = math.inf
    norm_l2: float = 0.0
    ulp_max: float = 0.0
    ulp_mean: float = 0.0
    share_over_1ulp: float = 0.0
    share_rel_over: dict[str, float] = field(default_factory=dict)
    error_balance: float = 0.0
    nan_mismatch: int = 0
    inf_mismatch: int = 0
    nan_where_ref_finite: int = 0
    exact_share: float = 1.0
    quantiles: dict[str, float] = field(default_factory=dict)
    histogram: list[int] = field(default_factory=list)
    mismatches: int | None = None  # integer/bool tensors only
    stats_delta: dict[str, float] | None = None  # summary bundles: relative statistics deltas
    source: str = "tensor"

    def __bool__(self) -> bool:
        return self.max_abs == 0 and self.nan_mismatch == 0 and self.inf_mismatch == 0 and not self.mismatches

    def as_dict(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        return {k: _jsonable(v) for k, v in out.items()}

    def get(self, name: str) -> float:
        """A scalar metric by name (``share_rel_over_1e-03``, ``p99``, ``delta_mean`` … included)."""
        if name.startswith("share_rel_over_"):
            return self.share_rel_over[name.removeprefix("share_rel_over_")]
        if name in self.quantiles:
            return self.quantiles[name]
        if name.startswith("delta_") and self.stats_delta is not None:
            return self.stats_delta[name.removeprefix("delta_")]
        value = getattr(self, name)
        return float(value)

    @property
    def finite_outcome(self) -> bool:
        """False when NaN/Inf patterns differ: a categorical outcome, not a number to band."""
        return not (self.nan_mismatch or self.inf_mismatch or self.nan_where_ref_finite)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else ("inf" if v > 0 else "-inf" if v < 0 else "nan")
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _rel_key(t: float) -> str:
    return f"{t:.0e}"


def _qname(q: float) -> str:
    return f"p{q * 100:g}"


class _Buffers:
    """Reused work buffers of the fast kernel for one chunk length (all float32 unless noted).

    ``sums`` stacks the four arrays whose plain sums are needed (``d``, ``|d|``, relative and
    scaled ULP errors) so a single matrix-vector product with ``ones`` gives all four sums.
    Constant operands of float comparisons/maxima are arrays (numpy's scalar-broadcast loops are
    slower than array-array loops for those); integer constants stay scalars.
    """

    __slots__ = ("sums", "d", "ad", "rel", "ulp", "bits", "wide", "mask", "ones", "guard")

    def __init__(self, n: int, guard: np.float32) -> None:
        self.sums = np.empty((4, n), np.float32)
        self.d, self.ad, self.rel, self.ulp = self.sums
        self.bits = np.empty(n, np.int32)
        self.wide = np.empty(n, np.intp)  # histogram codes, in np.bincount's own index type
        self.mask = np.empty(n, np.bool_)
        self.ones = np.ones(n, np.float32)
        self.guard = np.full(n, guard)


class _Accumulator:
    """Running float64 sums over chunks, plus the reused float32 buffers of the fast kernel."""

    def __init__(self, target_dtype: str, guard: float) -> None:
        self.mant, self.tiny = FLOAT_FORMATS.get(target_dtype, FLOAT_FORMATS["float32"])
        self.guard = guard
        self.guard32 = np.float32(max(guard, 2.0**-126))
        tiny32 = np.float32(max(self.tiny, 2.0**-126))
        self.tiny_exp_bits = np.int32(int(tiny32.view(np.int32)) & 0x7F800000)
        # ulp(r) uses max(|r|, tiny); when the relative-error guard is that same power of two,
        # the exponent bits can be read off max(|r|, guard) without a separate clamp
        self.guard_is_tiny = bool(self.guard32 == tiny32)
        self.ulp_one = np.float32(2.0**-self.mant)  # scaled ULP distance of exactly 1 ulp
        self.thresholds32 = tuple(np.float32(th) for th in REL_THRESHOLDS)
        self.numel = self.finite = self.exact = 0
        self.nan_mismatch = self.inf_mismatch = self.nan_where_ref_finite = 0
        self.sum_abs = self.sum_err = self.sum_sq_err = self.sum_sq_ref = self.dot_dr = 0.0
        self.sum_rel = self.sum_ulp = 0.0
        self.max_abs = self.max_rel = self.ulp_max = 0.0
        self.over_ulp = 0
        self.rel_over = [0] * len(REL_THRESHOLDS)
        self.fine = np.zeros(_FINE_SLOTS, np.int64)  # histogram by float32 bits >> 21
        self.zeros = 0
        self._bufs: dict[int, _Buffers] = {}

    def buffers(self, n: int) -> _Buffers:
        """Work buffers of chunk length ``n``."""
        bufs = self._bufs.get(n)
        if bufs is None:
            bufs = self._bufs[n] = _Buffers(n, self.guard32)
        return bufs


def compare_arrays(
    reference: np.ndarray | Iterable[np.ndarray],
    target: np.ndarray | Iterable[np.ndarray],
    target_dtype: str = "float32",
    ref_absmax: float | None = None,
) -> Metrics:
    """Compute :class:`Metrics` for two equally shaped arrays (or matching chunk iterators)."""
    tiny = FLOAT_FORMATS.get(target_dtype, FLOAT_FORMATS["float32"])[1]
    guard = max(machine_eps(target_dtype) * ref_absmax, tiny) if ref_absmax and math.isfinite(ref_absmax) else tiny
    acc = _Accumulator(target_dtype, guard)
    with np.errstate(all="ignore"):  # overflow/NaN in the float32 kernel sends the chunk to float64
        for r, t in zip(_chunks(reference), _chunks(target), strict=True):
            if r.shape != t.shape:
                raise ValueError(f"chunk shapes differ: {r.shape} vs {t.shape}")
            for start in range(0, r.shape[0], CHUNK):
                _chunk(acc, r[start : start + CHUNK], t[start : start + CHUNK])
    return _finish(acc)


def _chunks(x: np.ndarray | Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    if isinstance(x, np.ndarray):
        yield x.reshape(-1)
    else:
        yield from (np.asarray(c).reshape(-1) for c in x)


def _as_f32(x: np.ndarray) -> np.ndarray | None:
    """``x`` as float32 when that is exact (float32, float16), else None."""
    if x.dtype == np.float32:
        return x
    if x.dtype == np.float16:
        return x.astype(np.float32)
    return None


def _chunk(acc: _Accumulator, r: np.ndarray, t: np.ndarray) -> None:
    n = r.shape[0]
    if n == 0:
        return
    r32, t32 = _as_f32(r), _as_f32(t)
    if r32 is not None and t32 is not None and _fast_chunk(acc, r32, t32):
        return
    _exact_chunk(acc, r.astype(np.float64), t.astype(np.float64))


_SQ_UNDERFLOW = 2.0**-100  # sum of r^2 below this: every |r| < 1e-15, squares near float32's tiny
_ERR_UNDERFLOW = 2.0**-60  # largest |t - r| below this: its square is below 2^-120


def _fast_chunk(acc: _Accumulator, r: np.ndarray, t: np.ndarray) -> bool:
    """float32 kernel; returns False (having changed nothing) when a value is not finite."""
    n = r.shape[0]
    b = acc.buffers(n)
    d, ad = b.d, b.ad
    np.subtract(t, r, out=d)
    np.abs(d, out=ad)
    max_abs = float(ad.max())  # NaN or Inf anywhere in r or t makes this NaN or Inf
    if not math.isfinite(max_abs) or 0 < max_abs < _ERR_UNDERFLOW:
        return False  # tiny errors: their squares would underflow float32, use the float64 kernel
    sq_ref = float(np.dot(r, r))
    if not math.isfinite(sq_ref) or sq_ref < _SQ_UNDERFLOW:
        return False
    if max_abs == 0:  # an exact chunk: every error statistic is zero, every element a zero slot
        acc.numel += n
        acc.finite += n
        acc.sum_sq_ref += sq_ref
        acc.fine[0] += n
        acc.zeros += n
        return True
    sq_err = float(np.dot(d, d))
    dot_dr = float(np.dot(d, r))
    # relative error against the guarded |r|
    rel, bits = b.rel, b.bits
    np.abs(r, out=rel)
    np.maximum(rel, b.guard, out=rel)
    # ULP distance scaled by 2^-mant: |d| * 2^-exponent(max(|r|, tiny)), from the exponent bits
    if acc.guard_is_tiny:
        np.bitwise_and(rel.view(np.int32), np.int32(0x7F800000), out=bits)
    else:
        np.bitwise_and(r.view(np.int32), np.int32(0x7F800000), out=bits)
        np.maximum(bits, acc.tiny_exp_bits, out=bits)
    np.divide(ad, rel, out=rel)
    np.subtract(np.int32(254 << 23), bits, out=bits)  # the float32 bits of 2^-exponent
    ulp = b.ulp
    np.multiply(ad, bits.view(np.float32), out=ulp)
    sum_err, sum_abs, sum_rel, sum_ulp = (b.sums @ b.ones).tolist()
    if not all(map(math.isfinite, (sum_abs, sum_err, sq_err, dot_dr, sum_rel, sum_ulp))):
        return False
    acc.numel += n
    acc.finite += n
    acc.sum_abs += sum_abs
    acc.sum_err += sum_err
    acc.sum_sq_err += sq_err
    acc.sum_sq_ref += sq_ref
    acc.dot_dr += dot_dr
    acc.sum_rel += sum_rel
    acc.sum_ulp += sum_ulp * 2.0**acc.mant
    max_rel, ulp_max = float(rel.max()), float(ulp.max())
    acc.max_abs = max(acc.max_abs, max_abs)
    acc.max_rel = max(acc.max_rel, max_rel)
    acc.ulp_max = max(acc.ulp_max, ulp_max * 2.0**acc.mant)
    mask = b.mask
    if ulp_max > acc.ulp_one:  # counts are skipped when no element can be over
        acc.over_ulp += int(np.count_nonzero(np.greater(ulp, acc.ulp_one, out=mask)))
    for i, threshold in enumerate(acc.thresholds32):
        if max_rel > threshold:
            acc.rel_over[i] += int(np.count_nonzero(np.greater(rel, threshold, out=mask)))
    # histogram: the float32 bits of |d| >> 21 (exponent and top two mantissa bits)
    wide = b.wide
    np.right_shift(ad.view(np.int32), _SHIFT, out=wide)
    counts = np.bincount(wide)  # no minlength: the slots above the largest error stay as they are
    acc.fine[: counts.shape[0]] += counts
    if counts[0]:  # slot 0 holds exact zeros and subnormal errors
        acc.zeros += n - int(np.count_nonzero(ad.view(np.int32)))
    return True


def _exact_chunk(acc: _Accumulator, r: np.ndarray, t: np.ndarray) -> None:
    """float64 kernel with NaN/Inf bookkeeping."""
    acc.numel += r.size
    r_nan, t_nan = np.isnan(r), np.isnan(t)
    r_inf, t_inf = np.isinf(r), np.isinf(t)
    acc.nan_mismatch += int(np.count_nonzero(r_nan != t_nan))
    acc.nan_where_ref_finite += int(np.count_nonzero(t_nan & ~r_nan & ~r_inf))
    acc.inf_mismatch += int(np.count_nonzero((r_inf != t_inf) | (r_inf & t_inf & (np.sign(r) != np.sign(t)))))
    both = ~(r_nan | t_nan | r_inf | t_inf)
    if not both.all():
        acc.exact += int(np.count_nonzero(~both & ((r_nan & t_nan) | (r == t))))
        r, t = r[both], t[both]
    acc.finite += r.size
    if r.size == 0:
        return
    d = t - r
    ad = np.abs(d)
    acc.sum_abs += float(ad.sum())
    acc.sum_err += float(d.sum())
    acc.sum_sq_err += float(np.dot(d, d))
    acc.sum_sq_ref += float(np.dot(r, r))
    acc.dot_dr += float(np.dot(d, r))
    acc.max_abs = max(acc.max_abs, float(ad.max()))
    abs_r = np.abs(r)
    rel = ad / np.maximum(abs_r, acc.guard)
    acc.max_rel = max(acc.max_rel, float(rel.max()))
    acc.sum_rel += float(rel.sum())
    for i, threshold in enumerate(REL_THRESHOLDS):
        acc.rel_over[i] += int(np.count_nonzero(rel > threshold))
    _, exp = np.frexp(np.maximum(abs_r, acc.tiny))
    ulps = ad / np.ldexp(1.0, exp - 1 - acc.mant)
    acc.ulp_max = max(acc.ulp_max, float(ulps.max()))
    acc.sum_ulp += float(ulps.sum())
    acc.over_ulp += int(np.count_nonzero(ulps > 1.0))
    zero = ad == 0
    n_zero = int(np.count_nonzero(zero))
    acc.zeros += n_zero
    acc.fine[0] += n_zero  # as in the fast kernel, where zeros land in fine slot 0
    # histogram via the float32 bits of |error|: tiny errors clamp into the lowest slot, errors
    # beyond float32 range saturate to inf (the overflow slot)
    with np.errstate(over="ignore"):
        ad32 = np.maximum(ad[~zero], 2.0**-126).astype(np.float32)
    acc.fine += np.bincount(ad32.view(np.int32) >> _SHIFT, minlength=_FINE_SLOTS)


def _public_histogram(acc: _Accumulator) -> np.ndarray:
    fine = acc.fine.copy()
    fine[0] -= acc.zeros  # exact zeros share fine slot 0 with subnormal errors
    hist = np.zeros(HIST_SLOTS, np.int64)
    hist[0] = acc.zeros
    hist[1] = fine[:_FINE_LOW].sum()
    hist[2 : 2 + _N_BINS] = fine[_FINE_LOW:_FINE_HIGH]
    hist[-1] = fine[_FINE_HIGH:].sum()
    return hist


def _finish(acc: _Accumulator) -> Metrics:
    n, f = acc.numel, max(acc.finite, 1)
    m = Metrics(numel=n)
    m.share_rel_over = {_rel_key(t): 0.0 for t in REL_THRESHOLDS}
    m.quantiles = {_qname(q): 0.0 for q in QUANTILES}
    if n == 0:
        m.histogram = [0] * HIST_SLOTS
        return m
    hist = _public_histogram(acc)
    m.max_abs = acc.max_abs
    m.mean_abs = acc.sum_abs / f
    m.rmse = math.sqrt(acc.sum_sq_err / f)
    m.max_rel = acc.max_rel
    m.mean_rel = acc.sum_rel / f
    m.cosine = _cosine(acc.sum_sq_ref, acc.sum_sq_err, acc.dot_dr)
    m.snr_db = 10 * math.log10(acc.sum_sq_ref / acc.sum_sq_err) if acc.sum_sq_err > 0 and acc.sum_sq_ref > 0 else (
        math.inf if acc.sum_sq_err == 0 else -math.inf)
    m.norm_l2 = math.sqrt(acc.sum_sq_err / acc.sum_sq_ref) if acc.sum_sq_ref > 0 else (
        0.0 if acc.sum_sq_err == 0 else math.inf)
    m.ulp_max = acc.ulp_max
    m.ulp_mean = acc.sum_ulp / f
    m.share_over_1ulp = acc.over_ulp / f
    m.share_rel_over = {_rel_key(t): c / f for t, c in zip(REL_THRESHOLDS, acc.rel_over, strict=True)}
    m.error_balance = acc.sum_err / acc.sum_abs if acc.sum_abs > 0 else 0.0
    m.nan_mismatch = acc.nan_mismatch
    m.inf_mismatch = acc.inf_mismatch
    m.nan_where_ref_finite = acc.nan_where_ref_finite
    m.exact_share = (acc.exact + acc.zeros) / n
    m.histogram = hist.tolist()
    m.quantiles = {_qname(q): histogram_quantile(hist, q) for q in QUANTILES}
    return m


def _cosine(rr: float, dd: float, dr: float) -> float:
    """cos(r, t) from |r|^2, |d|^2 and d.r (t = r + d), accurate when it is close to 1."""
    tt = rr + 2 * dr + dd
    if rr <= 0 or tt <= 0:
        return 1.0 if dd == 0 else 0.0
    nr, nt = math.sqrt(rr), math.sqrt(max(tt, 0.0))
    diff = -(2 * dr + dd) / (nr + nt)  # |r| - |t| without cancellation
    one_minus = (dd - diff * diff) / (2 * nr * nt)
    return max(-1.0, min(1.0, 1.0 - one_minus))


def histogram_quantile(hist: np.ndarray | list[int], q: float) -> float:
    """The q-quantile of |error| read from the histogram, interpolated geometrically in its bin."""
    counts = np.asarray(hist, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return 0.0
    cum = np.cumsum(counts)
    rank = q * total
    idx = int(np.searchsorted(cum, rank, side="left"))
    if idx == 0:
        return 0.0
    lo, hi = slot_bounds(idx)
    if idx == 1 or idx == len(counts) - 1:
        return lo if idx == len(counts) - 1 else hi
    before = int(cum[idx - 1])
    frac = (rank - before) / max(int(counts[idx]), 1)
    return float(lo * (hi / lo) ** min(max(frac, 0.0), 1.0))


def slot_bounds(idx: int) -> tuple[float, float]:
    """``[low, high)`` of histogram slot ``idx`` (slot 0 is exact zeros, the last one overflow)."""
    if idx == 0:
        return 0.0, 0.0
    if idx == 1:
        return 0.0, float(HIST_EDGES[0])
    if idx >= HIST_SLOTS - 1:
        return float(HIST_EDGES[-1]), math.inf
    return float(HIST_EDGES[idx - 2]), float(HIST_EDGES[idx - 1])


def bin_value(idx: int) -> float:
    """Representative |error| of histogram slot ``idx`` (geometric midpoint of its bounds)."""
    lo, hi = slot_bounds(idx)
    if idx == 0:
        return 0.0
    if idx == 1:
        return hi
    if not math.isfinite(hi):
        return lo
    return math.sqrt(lo * hi)


def compare_discrete(reference: np.ndarray | Iterable[np.ndarray], target: np.ndarray | Iterable[np.ndarray]) -> Metrics:
    """Integer/bool tensors: exact comparison, mismatch count (chunked)."""
    n = mismatches = 0
    max_abs = sum_abs = 0.0
    for rc, tc in zip(_chunks(reference), _chunks(target), strict=True):
        for s in range(0, rc.shape[0], CHUNK):
            r, t = rc[s : s + CHUNK], tc[s : s + CHUNK]
            n += r.size
            neq = r != t
            k = int(np.count_nonzero(neq))
            if k:
                mismatches += k
                diff = np.abs(r[neq].astype(np.float64) - t[neq].astype(np.float64))
                max_abs = max(max_abs, float(diff.max()))
                sum_abs += float(diff.sum())
    m = Metrics(numel=n, mismatches=mismatches)
    m.exact_share = 1.0 - mismatches / n if n else 1.0
    m.max_abs = max_abs
    m.mean_abs = sum_abs / n if n else 0.0
    return m


#: Statistics compared for summary bundles, each as ``|t - r| / scale`` (see :func:`compare_stats`).
STATS_FIELDS = ("mean", "std", "l2", "absmax", "min", "max")


def compare_stats(ref: Any, tgt: Any, target_dtype: str = "float32") -> Metrics:
    """Metrics for a summary bundle pair: the element sample plus statistics deltas.

    ``stats_delta[name] = |stat_t - stat_r| / scale`` with ``scale = l2_r / sqrt(n)`` (the RMS of
    the reference) for mean/min/max and the reference statistic itself for std/l2/absmax.
    Two deltas bound the full-tensor error from below (triangle and Cauchy-Schwarz inequalities):
    ``norm_l2 >= |l2_t - l2_r| / l2_r`` and ``norm_l2 >= |mean_t - mean_r| sqrt(n) / l2_r``, and
    ``max_abs >= |absmax_t - absmax_r|``. ``norm_l2``/``max_abs`` report the larger of that bound
    and the sample estimate, so a summary op can fail on its statistics alone.
    """
    sample_r = np.asarray(ref.sample or [], np.float64)
    sample_t = np.asarray(tgt.sample or [], np.float64)
    if sample_r.size and sample_r.size == sample_t.size:
        m = compare_arrays(sample_r, sample_t, target_dtype, ref.absmax)
    else:
        m = _finish(_Accumulator(target_dtype, 0.0))
    m.numel, m.source = int(ref.numel), "summary"
    n = max(int(ref.numel), 1)
    rms = (ref.l2 / math.sqrt(n)) if ref.l2 else 0.0
    deltas: dict[str, float] = {}
    for name in STATS_FIELDS:
        a, b = getattr(ref, name, None), getattr(tgt, name, None)
        if a is None or b is None:
            continue
        scale = rms if name in ("mean", "min", "max") else abs(a)
        diff = abs(b - a)
        deltas[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    m.stats_delta = deltas
    if ref.l2:
        bound = max(deltas.get("l2", 0.0), abs((tgt.mean or 0.0) - (ref.mean or 0.0)) * math.sqrt(n) / ref.l2)
        m.norm_l2 = max(m.norm_l2, bound)
    if ref.absmax is not None and tgt.absmax is not None:
        m.max_abs = max(m.max_abs, abs(tgt.absmax - ref.absmax))
    nan_diff = abs(int(tgt.nan) - int(ref.nan))
    inf_diff = abs(int(tgt.inf) - int(ref.inf))
    m.nan_mismatch = max(m.nan_mismatch, nan_diff)
    m.inf_mismatch = max(m.inf_mismatch, inf_diff)
    if int(tgt.nan) > int(ref.nan):
        m.nan_where_ref_finite = max(m.nan_where_ref_finite, int(tgt.nan) - int(ref.nan))
    return m
