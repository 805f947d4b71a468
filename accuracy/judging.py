"""Judging aligned pairs: measure each pair (sharing measurements of repeated tensor pairs, batching small
ones), then hold the metrics to a budget, a golden ratio or the bands learned from history."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from accuracy.align import Pair, Unmatched, same_elements
from accuracy.bands import BandCheck, BandConfig, History, bands_for, benjamini_hochberg
from accuracy.budgets import DTYPE_MAX, Budget, BudgetPolicy, auxiliary_output, judged_dtype, precision_trap, reduction_length
from accuracy.bundle import Bundle
from accuracy.manifest import Record
from accuracy.metrics import Metrics, PairBatch, compare_arrays, compare_discrete, compare_stats, is_float_dtype
from accuracy.verdicts import Verdict, judge_bands, judge_budget, judge_golden, judge_nonfinite_history
from accuracy.results import OpResult

#: Metrics of this many recent (reference tensor, target tensor) pairs are kept for records that share them.
SHARED_METRICS = 1024
#: Pairs whose small tensors are measured together (one :class:`~accuracy.metrics.PairBatch`) before judging.
MEASURE_BATCH = 256


@dataclass
class JudgeContext:
    """What judging one comparison's pairs needs (its bundles, budgets, history), and the measurements it shares."""

    ref: Bundle
    tgt: Bundle
    golden: Bundle | None
    policy: BudgetPolicy
    mode: str
    variant: str
    history: History | None
    config: BandConfig
    target: str
    #: metrics by the stored tensor pair they were measured on (see :meth:`_measure_shared`)
    _shared: RecentMetrics = field(default_factory=lambda: RecentMetrics())
    #: metrics measured ahead of judging (:meth:`measure_ahead`), by the same keys, until a record takes them
    _ahead: dict[tuple[Any, ...], Metrics] = field(default_factory=dict)

    def measure_ahead(self, pairs: Sequence[Pair]) -> None:
        """Measure the pairs of small stored float tensors among ``pairs`` together (one
        :class:`~accuracy.metrics.PairBatch`: one compiled call per dtype combination instead of one per
        pair), before they are judged one by one; :meth:`_measure_shared` then takes each pair's metrics
        from here. The same numbers as measuring each alone. Golden comparisons measure one by one."""
        if self.golden is not None or len(pairs) < 2:
            return
        try:
            self._ahead.update(self._measured_together(pairs))
        except Exception:  # noqa: BLE001 - each pair is then measured alone, and any error reported with it
            return

    def _measured_together(self, pairs: Sequence[Pair]) -> list[tuple[tuple[Any, ...], Metrics]]:
        """(key, metrics) of the pairs :meth:`measure_ahead` batches (see there)."""
        batch: PairBatch | None = None
        keys: list[tuple[Any, ...]] = []
        queued: set[tuple[Any, ...]] = set()
        for pair in pairs:
            r, t = pair.reference, pair.target
            key = shared_key(self.ref, self.tgt, r, t)
            if (key is None or key in queued or key in self._shared or not same_elements(r, t)
                    or not is_float_dtype(r.dtype) or not is_float_dtype(t.dtype)):
                continue
            absmax, clip = _absmax_and_clip(r, t)
            if clip is not None:  # compared clipped: one by one
                continue
            assert r.tensor is not None and t.tensor is not None  # a shared key names both
            if batch is None:
                batch = PairBatch(self.ref.buffer(), self.tgt.buffer())
            if batch.add(self.ref.span(r.tensor), self.tgt.span(t.tensor), t.dtype, absmax):
                keys.append(key)
                queued.add(key)
        if batch is None or not keys:
            return []
        return list(zip(keys, batch.measure(), strict=True))

    def forget_ahead(self) -> None:
        """Drop metrics measured ahead that no judged record took (pairs judged without measuring)."""
        self._ahead.clear()

    def judge_pair(self, pair: Pair) -> OpResult:
        result = self._judge_values(pair)
        r, t = pair.reference, pair.target
        if r.layout != t.layout:  # values are stored in logical order: the comparison is by logical index
            result.layouts = (r.layout, t.layout)
            result.reason += f" (layouts differed: reference {r.layout}, target {t.layout}; compared by logical index)"
        aux = auxiliary_output(result.op, result.output)
        if aux is not None:
            result.auxiliary = aux
            if result.verdict in (Verdict.FAIL, Verdict.WARN):
                result.reason = f"auxiliary output ({aux}), reported, not judged alone: {result.reason}"
                result.verdict = Verdict.PASS
        return result

    def _judge_values(self, pair: Pair) -> OpResult:
        r, t = pair.reference, pair.target
        base = _base(pair)
        if not same_elements(r, t):
            return OpResult(**base, metrics=None, verdict=Verdict.FAIL, reason=f"shape differs: reference {r.shape}, target {t.shape}")
        if is_float_dtype(r.dtype) != is_float_dtype(t.dtype):
            return OpResult(**base, metrics=None, verdict=Verdict.FAIL,
                            reason=f"dtype kind differs: reference {r.dtype}, target {t.dtype}")
        gold = self._golden_record(r)
        try:
            metrics = self._measure_shared(self.golden if gold else self.ref, self.tgt, gold or r, t)
            ref_metrics = (self._measure_shared(self.golden, self.ref, gold, r)
                           if gold and self.golden is not None and self.golden is not self.ref else None)
        except Exception as e:  # noqa: BLE001 - our bug, reported with the pair, never the user's crash
            return OpResult(**base, metrics=None, verdict=Verdict.FAIL,
                            reason=f"internal error comparing {r.id}: {type(e).__name__}: {e} (please report)")
        if metrics is None:
            return OpResult(**base, metrics=None, verdict=Verdict.NEW, reason="no tensor or statistics to compare on one side")
        if metrics.mismatches is not None:
            verdict = Verdict.FAIL if metrics.mismatches else Verdict.PASS
            reason = f"{metrics.mismatches} of {metrics.numel} elements differ" if metrics.mismatches else "all elements equal"
            return OpResult(**base, metrics=metrics, verdict=verdict, reason=reason, budget=Budget(0.0, 1.0, "exact"))
        dtype = judged_dtype(r.dtype, t.dtype, self.variant, self.mode)
        k = reduction_length(t.op, t.input_shapes, t.shape)
        budget = self.policy.budget(r.key, t.op, t.kind, dtype, "replay" if self.mode == "golden" else self.mode, k)
        result = OpResult(**base, metrics=metrics, verdict=Verdict.PASS, reason="", budget=budget, reference_metrics=ref_metrics,
                          finding=precision_trap(r.dtype, t.dtype, self.variant))
        if self.history is not None and self._judge_history(result, dtype):
            return result
        if ref_metrics is not None:
            result.verdict, result.reason, result.golden_ratio = judge_golden(metrics, ref_metrics, budget)
        else:
            close = _outside_close(self.ref, self.tgt, r, t, budget) if budget.rtol is not None else None
            result.verdict, result.reason = judge_budget(metrics, budget, close)
            if self.golden is not None and gold is None:
                result.reason += " (no golden record: judged against the reference)"
            elif gold is not None:
                result.reason += " (vs fp64 golden; no reference outputs to compare its error with)"
        if result.finding:
            result.reason += f"; {result.finding}"
        return result

    def _measure_shared(self, ref: Bundle | None, tgt: Bundle, r: Record | None, t: Record) -> Metrics | None:
        """:func:`_measure`, once per stored tensor pair: records that name the same stored tensors (a
        module's output and the op output it aliases, e.g. ``q_proj/forward#0`` and its ``aten.mm#0``;
        bundle format 1.1 on) share their metrics, which depend on nothing else the key leaves out.
        Each record gets its own object (later ones a shallow copy). The last :data:`SHARED_METRICS` pairs are kept.
        A pair measured ahead (:meth:`measure_ahead`) is taken from there, as if measured now."""
        key = shared_key(ref, tgt, r, t)
        if key is None:
            return _measure(ref, tgt, r, t)
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            self._shared.put(key, ahead)
            return ahead
        if key in self._shared:
            return _copied(self._shared[key])
        metrics = _measure(ref, tgt, r, t)
        self._shared.put(key, metrics)  # the first record keeps it; later ones get copies
        return metrics

    def _golden_record(self, r: Record) -> Record | None:
        if self.golden is None:
            return None
        try:
            return self.golden.record(r.id)
        except KeyError:
            return None

    def _judge_history(self, result: OpResult, dtype: str) -> bool:
        """Judge against bands when there is enough history; False to fall back to the budget."""
        assert self.history is not None and result.metrics is not None
        op_id = result.op if result.output == 0 else f"{result.op}:{result.output}"  # bands per output
        bands, runs, nonfinite = bands_for(self.history, result.id, op_id, result.shape_signature,
                                           result.dtype, self.target, self.config)
        categorical = judge_nonfinite_history(result.metrics, runs, nonfinite) if runs >= self.config.min_history else None
        if categorical is not None:
            result.verdict, result.reason = categorical
            return True
        if not bands:
            return False
        m = result.metrics
        result.bands = [BandCheck(b, m.get(b.metric), b.p_value(m.get(b.metric))) for b in bands]
        out = [c.p_value for c in result.bands if c.out]
        result.p_value = min(1.0, min(out) * len(result.bands)) if out else 1.0
        return True


def apply_fdr(results: list[OpResult], cfg: BandConfig) -> None:
    """Benjamini-Hochberg across the banded ops of this comparison, then their verdicts."""
    banded = [r for r in results if r.bands and r.p_value is not None]
    reject = benjamini_hochberg([r.p_value for r in banded], cfg.fdr)  # type: ignore[misc]
    for r, significant in zip(banded, reject, strict=True):
        r.verdict, r.reason = judge_bands(r.bands, significant, len(banded))


def _base(pair: Pair) -> dict[str, Any]:
    t = pair.target
    return dict(
        key=pair.reference.key, output=pair.reference.output, op=t.op, module=t.module, kind=t.kind, index=t.index,
        input_shapes=t.input_shapes, shape=t.shape, dtype=t.dtype, reference_dtype=pair.reference.dtype,
        aligned_by=pair.how,
    )


def _measure(ref: Bundle | None, tgt: Bundle, r: Record | None, t: Record) -> Metrics | None:
    if ref is None or r is None:
        return None
    if r.tensor is not None and t.tensor is not None:
        if not is_float_dtype(r.dtype) or not is_float_dtype(t.dtype):
            return compare_discrete(ref.iter_chunks(r.tensor), tgt.iter_chunks(t.tensor))
        absmax, top = _absmax_and_clip(r, t)
        (rv, rtag), (tv, ttag) = ref.stored(r.tensor), tgt.stored(t.tensor)
        if top is not None:
            return compare_arrays(rv, tv, t.dtype, top, reference_dtype=rtag, stored_dtype=ttag, clip=top)
        return compare_arrays(rv, tv, t.dtype, absmax, reference_dtype=rtag, stored_dtype=ttag)
    if r.stats and t.stats:
        return compare_stats(r.stats, t.stats, t.dtype)
    return None


def _outside_close(ref: Bundle, tgt: Bundle, r: Record, t: Record, budget: Budget) -> float | None:
    """The share of elements outside torch.testing's ``|t - r| <= atol + rtol * |r|`` (NaN counts as
    outside), counted in float64 chunk by chunk; None when either side has statistics only."""
    if r.tensor is None or t.tensor is None or not (is_float_dtype(r.dtype) and is_float_dtype(t.dtype)):
        return None
    atol, rtol = budget.atol, float(budget.rtol or 0.0)
    outside = total = 0
    for rv, tv in zip(ref.iter_chunks(r.tensor), tgt.iter_chunks(t.tensor), strict=True):
        rv, tv = rv.astype(np.float64), tv.astype(np.float64)
        with np.errstate(invalid="ignore"):
            ok = np.abs(tv - rv) <= atol + rtol * np.abs(rv)
        ok |= (rv == tv)  # equal infinities
        outside += int(ok.size - np.count_nonzero(ok))
        total += ok.size
    return outside / total if total else 0.0


def _absmax_and_clip(r: Record, t: Record) -> tuple[float | None, float | None]:
    """The reference's recorded absmax, and the target dtype's largest value when the reference goes beyond
    it (the pair is then compared clipped to it), else None."""
    absmax = r.stats.absmax if r.stats else None
    top = DTYPE_MAX.get(t.dtype)
    return absmax, (top if top is not None and absmax is not None and absmax > top else None)


class RecentMetrics(OrderedDict[tuple[Any, ...], Any]):
    """The last :data:`SHARED_METRICS` entries put, the oldest dropped first (records that share a stored
    tensor pair are near each other in execution order)."""

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        self[key] = value
        if len(self) > SHARED_METRICS:
            self.popitem(last=False)


def shared_key(ref: Bundle | None, tgt: Bundle, r: Record | None, t: Record) -> tuple[Any, ...] | None:
    """What a measurement of ``r`` (in ``ref``) against ``t`` (in ``tgt``) depends on, for records that name
    stored tensors (None otherwise): records with equal keys get equal metrics."""
    if ref is None or r is None or r.tensor is None or t.tensor is None:
        return None
    return (id(ref), r.tensor, r.dtype, id(tgt), t.tensor, t.dtype, r.stats.absmax if r.stats else None)


def _copied(m: Metrics | None) -> Metrics | None:
    """A shallow copy of a metrics object (~10x cheaper than ``copy.copy`` of a dataclass)."""
    if m is None:
        return None
    out = Metrics.__new__(Metrics)
    out.__dict__.update(m.__dict__)
    return out


def unmatched_result(u: Unmatched) -> OpResult:
    rec = u.record
    return OpResult(
        key=rec.key, output=rec.output, op=rec.op, module=rec.module, kind=rec.kind, index=rec.index,
        input_shapes=rec.input_shapes, shape=rec.shape, dtype=rec.dtype, reference_dtype=rec.dtype, metrics=None,
        verdict=Verdict.MISSING if u.side == "reference" else Verdict.NEW,
        reason=("only in the reference: " if u.side == "reference" else "only in the target: ") + u.reason,
        aligned_by="none",
    )
