"""Error distributions between a reference and a target tensor, in one fused pass.

The element work is :mod:`accuracy.fused`'s error kernel (numba): one read of both arrays, in
their stored form (float32, float64, BF16/F16 words), computes every sum, maximum, threshold count,
the NaN/Inf bookkeeping and the exact histogram at once; chunks (``CHUNK`` elements per call, or a
bundle's chunks) and threads add into one accumulator, whose sums are float64. Pairs of 16/32-bit
floats are worked in float32 within blocks of 512 elements (a float32 difference is the exact one
correctly rounded; relative error of a block sum ~1e-6, far below the 3 digits the reports show);
a pair with a float64 side, a block with NaN/Inf, a float32 overflow, or squares near float32's
underflow is worked in float64. Cosine is derived from ``d = t - r``
(``1 - cos = (|d|^2 - (|r| - |t|)^2) / (2 |r| |t|)``), so it keeps its accuracy when it is
1 - 1e-12. ULP distances use the exponent bits, not ``frexp``. The histogram is exact: each
element's slot comes from the float32 bits of ``|d|`` shifted right by 21.

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

import functools
import math
import threading
from collections.abc import Iterable
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from accuracy import fused
from accuracy.capture_format import FLOAT_FORMATS, kernel_word

REL_THRESHOLDS = (1e-4, 1e-3, 5e-3)
QUANTILES = (0.5, 0.9, 0.99, 0.999)
CHUNK = 1 << 22  # elements per kernel call of an in-memory array (the kernel blocks them itself)

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
# the kernel's histogram code: 0 for exact zeros, else 1 + (float32 bits of |d| >> 21), where
# bits >> 21 = exponent * 4 + top two mantissa bits
_CODE_LOW = 1 + (HIST_LOW_EXP + 127) * HIST_PER_OCTAVE
_CODE_HIGH = 1 + (HIST_HIGH_EXP + 127) * HIST_PER_OCTAVE

INT_DTYPES = ("int8", "qint8", "quint8", "int16", "int32", "int64", "uint8", "bool", "qint32")


@functools.cache
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Metrics:
        """The exact inverse of :meth:`as_dict`, also after a JSON round trip: ``"inf"``/``"-inf"``/``"nan"``
        become floats again, fields left out (None) take their defaults. Unknown fields are refused."""
        unknown = set(d) - _FIELD_NAMES
        if unknown:
            raise ValueError(f"unknown metrics field(s) {sorted(unknown)}")
        return cls(**{k: v if k == "source" else _from_jsonable(v) for k, v in d.items()})

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


_FIELD_NAMES = frozenset(f.name for f in fields(Metrics))
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _from_jsonable(v: Any) -> Any:
    if isinstance(v, str):
        if v not in _NONFINITE:
            raise ValueError(f"not a number: {v!r}")
        return _NONFINITE[v]
    if isinstance(v, dict):
        return {k: _from_jsonable(x) for k, x in v.items()}
    return v


def _rel_key(t: float) -> str:
    return f"{t:.0e}"


def _qname(q: float) -> str:
    return f"p{q * 100:g}"


def _guard(target_dtype: str, ref_absmax: float | None) -> float:
    tiny = FLOAT_FORMATS.get(target_dtype, FLOAT_FORMATS["float32"])[1]
    if ref_absmax and math.isfinite(ref_absmax):
        return max(machine_eps(target_dtype) * ref_absmax, tiny)
    return tiny


def _accumulator(target_dtype: str, ref_absmax: float | None) -> fused.ErrorAccumulator:
    mant, tiny = FLOAT_FORMATS.get(target_dtype, FLOAT_FORMATS["float32"])
    return fused.ErrorAccumulator(_guard(target_dtype, ref_absmax), tiny, mant, REL_THRESHOLDS)


def compare_arrays(
    reference: np.ndarray | Iterable[np.ndarray],
    target: np.ndarray | Iterable[np.ndarray],
    target_dtype: str = "float32",
    ref_absmax: float | None = None,
    reference_dtype: str | None = None,
    stored_dtype: str | None = None,
    clip: float | None = None,
) -> Metrics:
    """Compute :class:`Metrics` for two equally shaped arrays (or matching chunk iterators).

    ``reference_dtype``/``stored_dtype``: the dtype names of the reference's and the target's
    values when the arrays hold raw words (``BF16`` as uint16), so they are read undecoded.
    ``clip``: compare both sides clamped to ``[-clip, clip]`` (Inf too; NaN stays NaN): a reference
    beyond the target dtype's range is judged by what the target can hold."""
    if clip is None and type(reference) is np.ndarray and type(target) is np.ndarray:  # most pairs: one kernel call
        rk, tk = _kernel_input(reference, reference_dtype), _kernel_input(target, stored_dtype)
        if rk.shape != tk.shape:
            raise ValueError(f"chunk shapes differ: {rk.shape} vs {tk.shape}")
        if rk.shape[0] < fused.PARALLEL_MIN:  # one part: one compiled call into scratch buffers
            return _small_pair(rk, tk, target_dtype, ref_absmax)
        if rk.shape[0] <= CHUNK:
            acc = _accumulator(target_dtype, ref_absmax)
            acc.add(rk, tk, fused.default_threads())
            return _finish(acc)
    acc = _accumulator(target_dtype, ref_absmax)
    threads = fused.default_threads()
    buffers: tuple[np.ndarray, np.ndarray] | None = None
    for r, t in zip(_chunks(reference), _chunks(target), strict=True):
        if r.shape != t.shape:
            raise ValueError(f"chunk shapes differ: {r.shape} vs {t.shape}")
        rk, tk = _kernel_input(r, reference_dtype), _kernel_input(t, stored_dtype)
        for start in range(0, max(rk.shape[0], 1), CHUNK):  # most tensors: one slice
            rs, ts = rk[start : start + CHUNK], tk[start : start + CHUNK]
            if clip is not None:
                if buffers is None or buffers[0].shape[0] < rs.shape[0]:  # one slice a side, in the pair's work type
                    work = np.float64 if np.float64 in (rs.dtype, ts.dtype) else np.float32
                    buffers = fused.clip_buffers(rs.shape[0], work)
                rs, ts = fused.clipped(rs, clip, buffers[0]), fused.clipped(ts, clip, buffers[1])
            acc.add(rs, ts, threads)
    return _finish(acc)


def _chunks(x: np.ndarray | Iterable[np.ndarray]) -> Iterable[np.ndarray]:
    if isinstance(x, np.ndarray):
        return (x.reshape(-1),)  # a tuple, not a generator: the common case, one array a side
    return (np.asarray(c).reshape(-1) for c in x)


def _kernel_input(x: np.ndarray, dtype: str | None) -> np.ndarray:
    """``x`` as the kernel reads it: stored floats as they are, anything else as float64."""
    k = fused.kernel_array(np.asarray(x), dtype)
    return k if k is not None else np.asarray(x, np.float64).reshape(-1)


_QUANTILE_RANKS = np.array(QUANTILES, np.float64)


def _finish(acc: fused.ErrorAccumulator) -> Metrics:
    n = int(acc.acc[_A_NUMEL])
    if n == 0:
        return _no_elements()
    hist = np.empty(HIST_SLOTS, np.int64)
    quantiles = np.empty(len(QUANTILES), np.float64)
    out = np.empty(len(fused.SUMMARY_FIELDS), np.float64)
    fused.error_summary(acc.acc, acc.hist, _CODE_LOW, _CODE_HIGH, _QUANTILE_RANKS, _SLOT_BOUND_ARRAY, 2.0**acc.mant,
                        hist, quantiles, out)
    return _summarised(n, hist, quantiles, out)


class _Scratch(threading.local):
    """Per-thread scratch of :func:`_small_pair` and :class:`PairBatch` (read out into the Metrics before
    either returns)."""

    def __init__(self) -> None:
        self.acc = np.zeros(len(fused.ACC_FIELDS), np.float64)
        self.codes = np.zeros(fused.N_CODES, np.int64)
        self.zero = np.zeros(1, np.int64)
        self.count = np.zeros(1, np.int64)
        self.guard = np.zeros(1, np.float64)
        self.n = np.zeros(1, np.float64)
        self.hist = np.empty((1, HIST_SLOTS), np.int64)
        self.quantiles = np.empty((1, len(QUANTILES)), np.float64)
        self.out = np.empty((1, len(fused.SUMMARY_FIELDS)), np.float64)


_SCRATCH = _Scratch()


def _small_pair(rk: np.ndarray, tk: np.ndarray, target_dtype: str, ref_absmax: float | None) -> Metrics:
    """:class:`Metrics` of one pair of flat kernel arrays below ``fused.PARALLEL_MIN`` elements: the
    accumulator's and ``_finish``'s numbers, by one compiled call (most of a model's tensors are small)."""
    s = _SCRATCH
    mant, tiny = FLOAT_FORMATS.get(target_dtype, FLOAT_FORMATS["float32"])
    guard, *args = fused.error_args(_guard(target_dtype, ref_absmax), tiny, mant, REL_THRESHOLDS)
    s.count[0], s.guard[0] = rk.shape[0], guard
    fused.batch_summary(rk, s.zero, tk, s.zero, s.count, s.guard, *args, s.acc, s.codes, _CODE_LOW, _CODE_HIGH,
                        _QUANTILE_RANKS, _SLOT_BOUND_ARRAY, 2.0**mant, s.hist, s.quantiles, s.out, s.n)
    n = int(s.n[0])
    return _summarised(n, s.hist[0], s.quantiles[0], s.out[0]) if n else _no_elements()


#: Pairs of at most this many elements are measured by :class:`PairBatch` (larger ones: one call each) …
BATCH_MAX = 1 << 16
#: … and of at most this many when a side's values lie unaligned in its buffer and must be copied.
PACK_MAX = 1 << 12
_SLOT_ALIGN = 8  # each pair's values start 8-byte aligned in the packed array


@dataclass
class _Group:
    """The pairs of one :class:`PairBatch` with the same stored dtypes and target format."""

    ref_words: np.dtype
    tgt_words: np.dtype
    mant: int
    tiny: float
    ref_aligned: bool  # every pair's values lie aligned in the buffer: read in place (else copied)
    tgt_aligned: bool
    positions: list[int] = field(default_factory=list)  # where each pair's Metrics goes in the batch's result
    ref_at: list[int] = field(default_factory=list)
    tgt_at: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    guards: list[float] = field(default_factory=list)


class PairBatch:
    """Small (reference, target) pairs that lie in two byte buffers (e.g. two mapped bundles), measured
    together: one compiled call per combination of stored dtypes reads them where they lie (values
    aligned to their size) or packed into one array (values a writer left unaligned: copied, so at most
    :data:`PACK_MAX` elements a pair). Each pair gets exactly the :class:`Metrics` :func:`compare_arrays`
    gives it alone."""

    def __init__(self, reference: np.ndarray, target: np.ndarray) -> None:
        """``reference``, ``target``: flat uint8 arrays the pairs' byte offsets point into."""
        self._buffers = (reference, target)
        self._bases = (reference.ctypes.data, target.ctypes.data)
        self._groups: dict[tuple[str, str, str, bool, bool], _Group] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, reference: tuple[int, int, str], target: tuple[int, int, str], target_dtype: str,
            ref_absmax: float | None) -> bool:
        """Queue a pair, each side as ``(byte offset into its buffer, byte count, stored dtype tag)`` (what
        ``Bundle.span`` gives); ``target_dtype`` and ``ref_absmax`` as for :func:`compare_arrays`. False
        (nothing queued) when the pair is not one to batch: larger than :data:`BATCH_MAX` elements, stored
        in a form the kernel does not read undecoded (FP8, integers), or of different sizes."""
        (ref_at, ref_bytes, ref_tag), (tgt_at, tgt_bytes, tgt_tag) = reference, target
        rw, tw = kernel_word(ref_tag), kernel_word(tgt_tag)
        if rw is None or tw is None:
            return False
        numel, rest = divmod(ref_bytes, rw.itemsize)
        ref_aligned = (self._bases[0] + ref_at) % rw.itemsize == 0
        tgt_aligned = (self._bases[1] + tgt_at) % tw.itemsize == 0
        if numel > (BATCH_MAX if ref_aligned and tgt_aligned else PACK_MAX) or rest or tgt_bytes != numel * tw.itemsize:
            return False
        fmt = target_dtype if target_dtype in FLOAT_FORMATS else "float32"
        where = (ref_tag, tgt_tag, fmt, ref_aligned, tgt_aligned)
        group = self._groups.get(where)
        if group is None:
            group = self._groups[where] = _Group(rw, tw, *FLOAT_FORMATS[fmt], ref_aligned, tgt_aligned)
        group.positions.append(self._count)
        group.ref_at.append(ref_at)
        group.tgt_at.append(tgt_at)
        group.counts.append(numel)
        group.guards.append(_guard(target_dtype, ref_absmax))
        self._count += 1
        return True

    def measure(self) -> list[Metrics]:
        """The queued pairs' metrics, in the order they were added."""
        out: list[Metrics | None] = [None] * self._count
        for group in self._groups.values():
            for position, metrics in zip(group.positions, self._measure_group(group), strict=True):
                out[position] = metrics
        return out  # type: ignore[return-value]

    def _measure_group(self, g: _Group) -> list[Metrics]:
        counts = np.array(g.counts, np.int64)
        r, roffs = _values(self._buffers[0], self._bases[0], g.ref_at, counts, g.ref_words, g.ref_aligned)
        t, toffs = _values(self._buffers[1], self._bases[1], g.tgt_at, counts, g.tgt_words, g.tgt_aligned)
        k = len(counts)
        hists = np.empty((k, HIST_SLOTS), np.int64)
        quantiles = np.empty((k, len(QUANTILES)), np.float64)
        outs = np.empty((k, len(fused.SUMMARY_FIELDS)), np.float64)
        ns = np.zeros(k, np.float64)
        s = _SCRATCH
        _, *args = fused.error_args(0.0, g.tiny, g.mant, REL_THRESHOLDS)
        fused.batch_summary(r, roffs, t, toffs, counts, np.array(g.guards, np.float64), *args, s.acc, s.codes,
                            _CODE_LOW, _CODE_HIGH, _QUANTILE_RANKS, _SLOT_BOUND_ARRAY, 2.0**g.mant, hists, quantiles,
                            outs, ns)
        return [_metrics_of(int(n), h, q, o) if n else _no_elements()
                for n, h, q, o in zip(ns.tolist(), hists.tolist(), quantiles.tolist(), outs.tolist(), strict=True)]


def _values(buffer: np.ndarray, base: int, begins: list[int], counts: np.ndarray, words: np.dtype,
            aligned: bool) -> tuple[np.ndarray, np.ndarray]:
    """One side of a group: an array of ``words`` holding every pair's values, and each pair's element
    offset in it; ``buffer`` itself (its address ``base``) when every pair's values lie aligned there."""
    if not aligned:
        return _packed(buffer, begins, counts, words)
    size = words.itemsize
    lead = -base % size  # the first aligned byte
    whole = buffer[lead : lead + (buffer.shape[0] - lead) // size * size].view(words)
    return whole, (np.array(begins, np.int64) - lead) // size


def _packed(buffer: np.ndarray, begins: list[int], counts: np.ndarray, words: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The values at ``begins`` (byte offsets into ``buffer``, ``counts`` elements of ``words`` each) copied
    into one array, each pair's values 8-byte aligned; returns it and each pair's element offset."""
    sizes = counts * words.itemsize
    padded = (sizes + _SLOT_ALIGN - 1) // _SLOT_ALIGN * _SLOT_ALIGN
    slots = np.zeros(len(sizes), np.int64)
    np.cumsum(padded[:-1], out=slots[1:])
    total = int(slots[-1] + padded[-1]) if len(sizes) else 0
    packed = np.empty(max(total, _SLOT_ALIGN), np.uint8)
    fused.gather_bytes(buffer, np.array(begins, np.int64), sizes, slots, packed)
    return packed.view(words), slots // words.itemsize


def _no_elements() -> Metrics:
    return Metrics(numel=0, share_rel_over=dict.fromkeys(_REL_KEYS, 0.0), quantiles=dict.fromkeys(_QNAMES, 0.0),
                   histogram=[0] * HIST_SLOTS)


def _summarised(n: int, hist: np.ndarray, quantiles: np.ndarray, out: np.ndarray) -> Metrics:
    """Metrics from error_summary's outputs (copied out of the arrays)."""
    return _metrics_of(n, hist.tolist(), quantiles.tolist(), out.tolist())


def _metrics_of(n: int, hist: list[int], quantiles: list[float], out: list[float]) -> Metrics:
    """Metrics from error_summary's outputs as lists (``hist`` becomes the Metrics' own list)."""
    (max_abs, mean_abs, rmse, max_rel, mean_rel, cosine, snr_db, norm_l2, ulp_max, ulp_mean, over_ulp, r0, r1, r2,
     balance, nan_mm, inf_mm, nan_rf, exact_share) = out
    return Metrics(n, max_abs, mean_abs, rmse, max_rel, mean_rel, cosine, snr_db, norm_l2, ulp_max, ulp_mean, over_ulp,
                   dict(zip(_REL_KEYS, (r0, r1, r2), strict=True)), balance, int(nan_mm), int(inf_mm), int(nan_rf),
                   exact_share, dict(zip(_QNAMES, quantiles, strict=True)), hist)


_A_NUMEL = fused.A["numel"]
_REL_KEYS = tuple(_rel_key(t) for t in REL_THRESHOLDS)


_QNAMES = tuple(_qname(q) for q in QUANTILES)


def histogram_quantile(hist: np.ndarray | list[int], q: float) -> float:
    """The q-quantile of |error| read from the histogram, interpolated geometrically in its bin
    (the same compiled reading as the metric suite's quantiles)."""
    counts = np.asarray(hist, dtype=np.int64)
    out = np.empty(1, np.float64)
    fused.histogram_quantiles(counts, int(counts.sum()), np.array([q], np.float64), _SLOT_BOUND_ARRAY, out)
    return float(out[0])


def slot_bounds(idx: int) -> tuple[float, float]:
    """``[low, high)`` of histogram slot ``idx`` (slot 0 is exact zeros, the last one overflow)."""
    if idx == 0:
        return 0.0, 0.0
    if idx == 1:
        return 0.0, float(HIST_EDGES[0])
    if idx >= HIST_SLOTS - 1:
        return float(HIST_EDGES[-1]), math.inf
    return float(HIST_EDGES[idx - 2]), float(HIST_EDGES[idx - 1])


_SLOT_BOUND_ARRAY = np.array([slot_bounds(i) for i in range(HIST_SLOTS)], np.float64)  # what the compiled quantiles read


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
        m = _finish(_accumulator(target_dtype, None))
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
