"""The comparison pipeline: align two bundles, measure each pair, judge it, find the first divergence."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from accuracy.align import Pair, Unmatched, align, same_elements
from accuracy.budgets import WARN_FACTOR, Budget, BudgetPolicy, effective_dtype
from accuracy.bundle import Bundle
from accuracy.manifest import Record
from accuracy.metrics import Metrics, compare_arrays, compare_discrete, is_float_dtype

VERDICT_ORDER = ("pass", "new", "missing", "warn", "fail")
MODES = ("propagated", "replay", "golden")


@dataclass
class OpResult:
    """The judged comparison of one aligned op output."""

    key: str
    output: int
    op: str
    module: str
    kind: str
    index: int
    input_shapes: list[list[int] | None]
    shape: list[int]
    dtype: str
    reference_dtype: str
    metrics: Metrics | None
    verdict: str
    reason: str
    budget: Budget | None = None
    aligned_by: str = "key"
    inherited: bool = False

    @property
    def id(self) -> str:
        return self.key if self.output == 0 else f"{self.key}:{self.output}"

    @property
    def shape_signature(self) -> str:
        from accuracy.manifest import shape_signature

        return shape_signature(self.input_shapes)

    @property
    def severity(self) -> float:
        """How far out of budget this op is (error / budget); orders the table worst first."""
        if self.metrics is None or self.budget is None:
            return math.inf if self.verdict == "fail" else 0.0
        if self.metrics.nan_where_ref_finite or self.metrics.inf_mismatch or self.metrics.nan_mismatch:
            return math.inf
        if self.budget.norm_l2 == 0:
            return math.inf if self.metrics.norm_l2 > 0 else 0.0
        return self.metrics.norm_l2 / self.budget.norm_l2


@dataclass
class ComparisonReport:
    """Everything one comparison found. Truthy when no op failed."""

    reference: dict[str, Any]
    target: dict[str, Any]
    mode: str
    ops: list[OpResult]
    unmatched: list[Unmatched]
    first_divergence: OpResult | None
    verdict: str
    counts: dict[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.verdict != "fail"

    def worst_first(self) -> list[OpResult]:
        return sorted(self.ops, key=lambda o: (-VERDICT_ORDER.index(o.verdict), -o.severity, o.index))


def worst_verdict(verdicts: list[str]) -> str:
    return max(verdicts, key=VERDICT_ORDER.index) if verdicts else "pass"


def compare(
    reference: str | os.PathLike[str] | Bundle,
    target: str | os.PathLike[str] | Bundle,
    *,
    mode: str = "propagated",
    budgets: Mapping[str, Any] | BudgetPolicy | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ComparisonReport:
    """Compare two bundles op by op and return the report the CLI, API and gate all render."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    ref = reference if isinstance(reference, Bundle) else Bundle.open(reference)
    tgt = target if isinstance(target, Bundle) else Bundle.open(target)
    policy = budgets if isinstance(budgets, BudgetPolicy) else BudgetPolicy.from_config(budgets)
    pairs, unmatched = align(ref.records, tgt.records)
    variant = tgt.manifest.variant
    results: list[OpResult] = []
    for i, pair in enumerate(pairs):
        results.append(_judge_pair(ref, tgt, pair, policy, mode, variant))
        if progress:
            progress(i + 1, len(pairs))
    results += [_unmatched_result(u) for u in unmatched]
    first = _mark_first_divergence(results, mode)
    counts = {v: sum(1 for r in results if r.verdict == v) for v in VERDICT_ORDER}
    return ComparisonReport(
        reference=_side(ref),
        target=_side(tgt),
        mode=mode,
        ops=results,
        unmatched=unmatched,
        first_divergence=first,
        verdict=worst_verdict([r.verdict for r in results]),
        counts=counts,
    )


def _side(b: Bundle) -> dict[str, Any]:
    return {"path": str(b.path), "run": b.manifest.run, "records": len(b.records)}


def _base(pair: Pair) -> dict[str, Any]:
    t = pair.target
    return dict(
        key=pair.reference.key,
        output=pair.reference.output,
        op=t.op,
        module=t.module,
        kind=t.kind,
        index=t.index,
        input_shapes=t.input_shapes,
        shape=t.shape,
        dtype=t.dtype,
        reference_dtype=pair.reference.dtype,
        aligned_by=pair.how,
    )


def _judge_pair(ref: Bundle, tgt: Bundle, pair: Pair, policy: BudgetPolicy, mode: str, variant: str) -> OpResult:
    r, t = pair.reference, pair.target
    base = _base(pair)
    if not same_elements(r, t):
        return OpResult(**base, metrics=None, verdict="fail", reason=f"shape differs: reference {r.shape}, target {t.shape}")
    if is_float_dtype(r.dtype) != is_float_dtype(t.dtype):
        return OpResult(**base, metrics=None, verdict="fail", reason=f"dtype kind differs: reference {r.dtype}, target {t.dtype}")
    try:
        metrics = _measure(ref, tgt, r, t)
    except Exception as e:  # noqa: BLE001 - our bug, reported with the pair, never the user's crash
        return OpResult(**base, metrics=None, verdict="fail", reason=f"internal error comparing {r.id}: {type(e).__name__}: {e} (please report)")
    if metrics is None:
        return OpResult(**base, metrics=None, verdict="new", reason="no tensor or statistics to compare on one side")
    if metrics.mismatches is not None:
        verdict = "fail" if metrics.mismatches else "pass"
        reason = f"{metrics.mismatches} of {metrics.numel} elements differ" if metrics.mismatches else "all elements equal"
        return OpResult(**base, metrics=metrics, verdict=verdict, reason=reason, budget=Budget(0.0, 1.0, "exact"))
    budget = policy.budget(r.key, t.op, t.kind, effective_dtype(t.dtype, variant, mode), mode)
    verdict, reason = judge(metrics, budget)
    return OpResult(**base, metrics=metrics, verdict=verdict, reason=reason, budget=budget)


def judge(metrics: Metrics, budget: Budget) -> tuple[str, str]:
    """Verdict and reason in words for one op's metrics against a budget."""
    if metrics.nan_where_ref_finite:
        return "fail", f"{metrics.nan_where_ref_finite} NaN where the reference is finite"
    if metrics.nan_mismatch or metrics.inf_mismatch:
        return "fail", f"NaN/Inf pattern differs ({metrics.nan_mismatch} NaN, {metrics.inf_mismatch} Inf mismatches)"
    err, limit = metrics.norm_l2, budget.norm_l2
    if err <= limit and metrics.cosine >= budget.cosine_min:
        return "pass", f"norm_l2 {err:.1e} <= {limit:.1e} ({budget.source})"
    if err <= limit * WARN_FACTOR and metrics.cosine >= budget.cosine_min:
        return "warn", f"norm_l2 {err:.1e} > {limit:.1e} by less than {WARN_FACTOR:g}x ({budget.source})"
    if err > limit:
        return "fail", f"norm_l2 {err:.1e} > {limit:.1e} ({budget.source})"
    return "fail", f"cosine {metrics.cosine:.6f} < {budget.cosine_min:.6f} ({budget.source})"


def _measure(ref: Bundle, tgt: Bundle, r: Record, t: Record) -> Metrics | None:
    if r.tensor is not None and t.tensor is not None:
        if not is_float_dtype(r.dtype):
            return compare_discrete(ref.values(r.tensor), tgt.values(t.tensor))
        absmax = r.stats.absmax if r.stats and r.stats.absmax is not None else None
        return compare_arrays(ref.iter_chunks(r.tensor), tgt.iter_chunks(t.tensor), t.dtype, absmax)
    if r.stats and t.stats and r.stats.sample and t.stats.sample and len(r.stats.sample) == len(t.stats.sample):
        # summary bundles: the deterministic element sample stands in for the tensor
        return compare_arrays(np.asarray(r.stats.sample), np.asarray(t.stats.sample), t.dtype, r.stats.absmax)
    return None


def _unmatched_result(u: Unmatched) -> OpResult:
    rec = u.record
    return OpResult(
        key=rec.key,
        output=rec.output,
        op=rec.op,
        module=rec.module,
        kind=rec.kind,
        index=rec.index,
        input_shapes=rec.input_shapes,
        shape=rec.shape,
        dtype=rec.dtype,
        reference_dtype=rec.dtype,
        metrics=None,
        verdict="missing" if u.side == "reference" else "new",
        reason=("only in the reference: " if u.side == "reference" else "only in the target: ") + u.reason,
        aligned_by="none",
    )


def _mark_first_divergence(results: list[OpResult], mode: str) -> OpResult | None:
    """The earliest out-of-budget op in execution order; later failures are marked inherited.

    ATen-level records are preferred (they name the op); module records are used when the
    bundle has no ATen records. In replay and golden modes every failure is local.
    """
    bad = [r for r in results if r.verdict in ("fail", "warn") and r.aligned_by != "none"]
    if not bad:
        return None
    fine = [r for r in bad if r.kind != "module"] or bad
    first = min(fine, key=lambda r: r.index)
    if mode == "propagated":
        for r in bad:
            r.inherited = r is not first and r.index > first.index and r.kind == first.kind
    return first
