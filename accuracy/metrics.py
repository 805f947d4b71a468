"""Error distributions between a reference and a target tensor, in one chunked float64 pass.

Relative error uses a small-value guard: ``rel = |t - r| / max(|r|, guard)`` where
``guard = eps(target dtype) * absmax(r)`` when the reference's absmax is known up front (from its
recorded statistics) and the smallest normal of the target dtype otherwise. Without the guard a
reference element of 1e-30 would turn any rounding into an astronomic relative error.

Quantiles of the absolute error are read from a fixed log-spaced histogram (8 bins per decade,
1e-12 .. 1e4), so they carry at most one bin (a factor 10^(1/8) = 1.33) of resolution error; the
histogram is stored per op and plotted by the reports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

#: Histogram of |t - r|: slot 0 counts exact zeros, slot 1 errors below 1e-12, then log-spaced
#: bins between consecutive edges, and the last slot errors of 1e4 and more.
HIST_LOW_EXP, HIST_HIGH_EXP, HIST_PER_DECADE = -12, 4, 8
HIST_EDGES = np.logspace(HIST_LOW_EXP, HIST_HIGH_EXP, (HIST_HIGH_EXP - HIST_LOW_EXP) * HIST_PER_DECADE + 1)
REL_THRESHOLDS = (1e-4, 1e-3, 5e-3)
QUANTILES = (0.5, 0.9, 0.99, 0.999)
CHUNK = 1 << 20

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


def machine_eps(dtype: str) -> float:
    """Unit roundoff (half an ulp at 1.0) of a float dtype name; int8 uses its 1/127 step."""
    if dtype in FLOAT_FORMATS:
        return 2.0 ** -(FLOAT_FORMATS[dtype][0] + 1)
    if dtype in ("int8", "qint8", "quint8"):
        return 1.0 / 254.0
    return 0.0


def is_float_dtype(dtype: str) -> bool:
    return dtype in FLOAT_FORMATS or dtype.startswith("complex")


@dataclass
class Metrics:
    """The error distribution of one (reference, target) pair. Truthy when values are equal."""

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

    def __bool__(self) -> bool:
        return self.max_abs == 0 and self.nan_mismatch == 0 and self.inf_mismatch == 0 and not self.mismatches

    def as_dict(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        return {k: (_finite_or_str(v) if isinstance(v, float) else v) for k, v in out.items()}

    def get(self, name: str) -> float:
        """A scalar metric by name (``share_rel_over_1e-03``, ``p99`` … included)."""
        if name.startswith("share_rel_over_"):
            return self.share_rel_over[name.removeprefix("share_rel_over_")]
        if name in self.quantiles:
            return self.quantiles[name]
        value = getattr(self, name)
        return float(value)


def _finite_or_str(v: float) -> float | str:
    return v if math.isfinite(v) else ("inf" if v > 0 else "-inf" if v < 0 else "nan")


def _rel_key(t: float) -> str:
    return f"{t:.0e}"


@dataclass
class _Accumulator:
    numel: int = 0
    sum_abs: float = 0.0
    sum_sq_err: float = 0.0
    sum_sq_ref: float = 0.0
    sum_sq_tgt: float = 0.0
    dot: float = 0.0
    sum_err: float = 0.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    sum_rel: float = 0.0
    ulp_max: float = 0.0
    sum_ulp: float = 0.0
    over_ulp: int = 0
    rel_over: np.ndarray = field(default_factory=lambda: np.zeros(len(REL_THRESHOLDS), np.int64))
    exact: int = 0
    finite: int = 0
    nan_mismatch: int = 0
    inf_mismatch: int = 0
    nan_where_ref_finite: int = 0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(len(HIST_EDGES) + 2, np.int64))


def compare_arrays(
    reference: np.ndarray | Iterable[np.ndarray],
    target: np.ndarray | Iterable[np.ndarray],
    target_dtype: str = "float32",
    ref_absmax: float | None = None,
) -> Metrics:
    """Compute :class:`Metrics` for two equally shaped arrays (or matching chunk iterators)."""
    ref_chunks = _chunks(reference)
    tgt_chunks = _chunks(target)
    mant, tiny = FLOAT_FORMATS.get(target_dtype, FLOAT_FORMATS["float32"])
    guard = max(machine_eps(target_dtype) * ref_absmax, tiny) if ref_absmax else tiny
    acc = _Accumulator()
    for r, t in zip(ref_chunks, tgt_chunks, strict=True):
        if r.shape != t.shape:
            raise ValueError(f"chunk shapes differ: {r.shape} vs {t.shape}")
        _accumulate(acc, r.astype(np.float64, copy=False), t.astype(np.float64, copy=False), guard, mant, tiny)
    return _finish(acc)


def _chunks(x: np.ndarray | Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    if isinstance(x, np.ndarray):
        flat = x.reshape(-1)
        for start in range(0, max(flat.shape[0], 1), CHUNK):
            yield flat[start : start + CHUNK]
    else:
        yield from (np.asarray(c).reshape(-1) for c in x)


def _accumulate(acc: _Accumulator, r: np.ndarray, t: np.ndarray, guard: float, mant: int, tiny: float) -> None:
    acc.numel += r.size
    if r.size == 0:
        return
    r_nan, t_nan = np.isnan(r), np.isnan(t)
    r_inf, t_inf = np.isinf(r), np.isinf(t)
    acc.nan_mismatch += int(np.count_nonzero(r_nan != t_nan))
    acc.nan_where_ref_finite += int(np.count_nonzero(t_nan & ~r_nan & ~r_inf))
    acc.inf_mismatch += int(np.count_nonzero((r_inf != t_inf) | (r_inf & t_inf & (np.sign(r) != np.sign(t)))))
    both = np.isfinite(r) & np.isfinite(t)
    if not both.all():
        # equal non-finite values count as exact; others are reported through the mismatch counts
        acc.exact += int(np.count_nonzero(~both & ((r_nan & t_nan) | (r == t))))
        r, t = r[both], t[both]
    acc.finite += r.size
    err = t - r
    abs_err = np.abs(err)
    abs_ref = np.abs(r)
    acc.sum_abs += float(abs_err.sum())
    acc.sum_sq_err += float(np.dot(err, err))
    acc.sum_sq_ref += float(np.dot(r, r))
    acc.sum_sq_tgt += float(np.dot(t, t))
    acc.dot += float(np.dot(r, t))
    acc.sum_err += float(err.sum())
    if abs_err.size:
        acc.max_abs = max(acc.max_abs, float(abs_err.max()))
    rel = abs_err / np.maximum(abs_ref, guard)
    if rel.size:
        acc.max_rel = max(acc.max_rel, float(rel.max()))
    acc.sum_rel += float(rel.sum())
    for i, threshold in enumerate(REL_THRESHOLDS):
        acc.rel_over[i] += int(np.count_nonzero(rel > threshold))
    # ulp of the reference value at the target precision, floored at the subnormal spacing
    _, exp = np.frexp(np.maximum(abs_ref, tiny))
    ulp = np.ldexp(1.0, exp - 1 - mant)
    ulps = abs_err / ulp
    if ulps.size:
        acc.ulp_max = max(acc.ulp_max, float(ulps.max()))
    acc.sum_ulp += float(ulps.sum())
    acc.over_ulp += int(np.count_nonzero(ulps > 1.0))
    zero = abs_err == 0
    n_zero = int(np.count_nonzero(zero))
    acc.exact += n_zero
    acc.hist[0] += n_zero
    if n_zero < abs_err.size:
        bins = np.searchsorted(HIST_EDGES, abs_err[~zero], side="right")
        acc.hist[1:] += np.bincount(bins, minlength=len(HIST_EDGES) + 1)


def _finish(acc: _Accumulator) -> Metrics:
    n, f = acc.numel, max(acc.finite, 1)
    m = Metrics(numel=n)
    if n == 0:
        m.share_rel_over = {_rel_key(t): 0.0 for t in REL_THRESHOLDS}
        m.quantiles = {f"p{_qname(q)}": 0.0 for q in QUANTILES}
        m.histogram = acc.hist.tolist()
        return m
    m.max_abs = acc.max_abs
    m.mean_abs = acc.sum_abs / f
    m.rmse = math.sqrt(acc.sum_sq_err / f)
    m.max_rel = acc.max_rel
    m.mean_rel = acc.sum_rel / f
    denom = math.sqrt(acc.sum_sq_ref) * math.sqrt(acc.sum_sq_tgt)
    m.cosine = acc.dot / denom if denom > 0 else (1.0 if acc.sum_sq_err == 0 else 0.0)
    m.snr_db = 10 * math.log10(acc.sum_sq_ref / acc.sum_sq_err) if acc.sum_sq_err > 0 else math.inf
    m.norm_l2 = (
        math.sqrt(acc.sum_sq_err / acc.sum_sq_ref) if acc.sum_sq_ref > 0 else (0.0 if acc.sum_sq_err == 0 else math.inf)
    )
    m.ulp_max = acc.ulp_max
    m.ulp_mean = acc.sum_ulp / f
    m.share_over_1ulp = acc.over_ulp / f
    m.share_rel_over = {_rel_key(t): int(c) / f for t, c in zip(REL_THRESHOLDS, acc.rel_over, strict=True)}
    m.error_balance = acc.sum_err / acc.sum_abs if acc.sum_abs > 0 else 0.0
    m.nan_mismatch = acc.nan_mismatch
    m.inf_mismatch = acc.inf_mismatch
    m.nan_where_ref_finite = acc.nan_where_ref_finite
    m.exact_share = acc.exact / n
    m.histogram = acc.hist.tolist()
    m.quantiles = {f"p{_qname(q)}": histogram_quantile(acc.hist, q) for q in QUANTILES}
    return m


def _qname(q: float) -> str:
    return f"{q * 100:g}"


def histogram_quantile(hist: np.ndarray | list[int], q: float) -> float:
    """The q-quantile of |error| read from the log histogram (geometric midpoint of its bin)."""
    counts = np.asarray(hist, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return 0.0
    idx = int(np.searchsorted(np.cumsum(counts), q * total, side="left"))
    return bin_value(idx)


def bin_value(idx: int) -> float:
    """Representative |error| of histogram slot ``idx``: 0 = exact, 1 = below 1e-12, last = overflow."""
    j = idx - 1
    if idx == 0:
        return 0.0
    if j == 0:
        return float(HIST_EDGES[0])
    if j >= len(HIST_EDGES):
        return float(HIST_EDGES[-1])
    return float(math.sqrt(HIST_EDGES[j - 1] * HIST_EDGES[j]))


def compare_discrete(reference: np.ndarray, target: np.ndarray) -> Metrics:
    """Integer/bool tensors: exact comparison, mismatch count."""
    r = np.asarray(reference).reshape(-1)
    t = np.asarray(target).reshape(-1)
    mismatches = int(np.count_nonzero(r != t))
    m = Metrics(numel=r.size, mismatches=mismatches)
    m.exact_share = 1.0 - mismatches / r.size if r.size else 1.0
    if mismatches:
        diff = np.abs(r.astype(np.float64) - t.astype(np.float64))
        m.max_abs = float(diff.max())
        m.mean_abs = float(diff.mean())
    return m
