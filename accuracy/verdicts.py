"""Verdicts in words: one op's metrics against a budget, a golden ratio, or bands from history.

Every function returns ``(verdict, reason)``; the reason says what failed, by how much, against
what (``max rel err 3.1e-02 > band 4.0e-03 (99%/95% tolerance bound of 12 accepted runs)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from accuracy.bands import BandCheck
from accuracy.budgets import GOLDEN_RATIO, WARN_FACTOR, Budget
from accuracy.metrics import Metrics


class Verdict(StrEnum):
    """One op's (or a comparison's) outcome; equal to its lower-case name, as reports and the API spell it."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    NEW = "new"  # only the target has the op (e.g. the casts a bf16 run adds)
    MISSING = "missing"  # only the reference has the op


#: Best to worst: a comparison's verdict is the worst of its ops' by this order.
VERDICT_ORDER = (Verdict.PASS, Verdict.NEW, Verdict.MISSING, Verdict.WARN, Verdict.FAIL)
#: How tables rank ops, best to worst: a comparison's verdict is still the worst by VERDICT_ORDER,
#: but target-only ops ("new": e.g. the casts a bf16 run adds) carry no error, so worst-first
#: tables list out-of-band, missing and measured ops before them.
TABLE_ORDER = (Verdict.NEW, Verdict.PASS, Verdict.MISSING, Verdict.WARN, Verdict.FAIL)
LABELS = {"norm_l2": "norm L2 err", "max_rel": "max rel err", "max_abs": "max abs err", "mean_rel": "mean rel err",
          "rmse": "RMSE", "ulp_max": "max ULP err", "p99.9": "p99.9 abs err", "p99": "p99 abs err"}


def label(metric: str) -> str:
    return LABELS.get(metric, metric)


def worst_verdict(verdicts: Sequence[str]) -> Verdict:
    return Verdict(max(verdicts, key=VERDICT_ORDER.index)) if verdicts else Verdict.PASS


def nonfinite_reason(m: Metrics) -> str | None:
    """Words for a NaN/Inf pattern that differs from the reference, or None."""
    if m.nan_where_ref_finite:
        return f"{m.nan_where_ref_finite} NaN where the reference is finite"
    if m.nan_mismatch or m.inf_mismatch:
        return f"NaN/Inf pattern differs ({m.nan_mismatch} NaN, {m.inf_mismatch} Inf mismatches)"
    return None


def judge_budget(m: Metrics, budget: Budget, outside_close: float | None = None) -> tuple[str, str]:
    """Verdict of one op's metrics against a budget; ``outside_close``: the share of elements outside
    ``atol + rtol * |r|`` when the budget has an ``rtol`` and the tensors were there to count it."""
    bad = nonfinite_reason(m)
    if bad:
        return Verdict.FAIL, bad
    if budget.limits or budget.rtol is not None:
        extra = _judge_limits(m, budget, outside_close)
        if extra[0] != Verdict.PASS or math.isinf(budget.norm_l2):
            return extra
    err, limit = m.norm_l2, budget.norm_l2
    what = "summary norm L2 err" if m.source == "summary" else "norm L2 err"
    if err > limit and budget.atol > 0 and m.source == "tensor" and m.rmse <= budget.atol:
        return Verdict.PASS, (f"RMS err {m.rmse:.1e} <= absolute floor {budget.atol:.1e} ({budget.source}): values near the "
                        f"dtype's underflow range, where {what} {err:.1e} says nothing")
    if err <= limit and m.cosine >= budget.cosine_min:
        return Verdict.PASS, f"{what} {err:.1e} <= budget {limit:.1e} ({budget.source})"
    if err <= limit * WARN_FACTOR and m.cosine >= budget.cosine_min:
        return Verdict.WARN, f"{what} {err:.1e} > budget {limit:.1e} by less than {WARN_FACTOR:g}x ({budget.source})"
    if err > limit:
        return Verdict.FAIL, f"{what} {err:.1e} > budget {limit:.1e} ({budget.source})"
    return Verdict.FAIL, f"cosine {m.cosine:.6f} < {budget.cosine_min:.6f} ({budget.source})"


def _judge_limits(m: Metrics, budget: Budget, outside_close: float | None) -> tuple[str, str]:
    """An override's limits on other metrics: FAIL at the first one exceeded, WARN when atol/rtol could not
    be checked (statistics only), else PASS with every value against its limit."""
    summary = "summary " if m.source == "summary" else ""
    said = []
    for name, limit in budget.limits:
        try:
            value = m.get(name)
        except (KeyError, AttributeError):
            return Verdict.WARN, f"{name} not measured on this op ({budget.source}): not judged against {limit:.1e}"
        words = label(name) if not name.startswith("share_rel_over_") else \
            f"share of elements with rel err > {name.removeprefix('share_rel_over_')}"
        if value > limit:
            return Verdict.FAIL, f"{summary}{words} {value:.3g} > budget {limit:.3g} ({budget.source})"
        said.append(f"{summary}{words} {value:.3g} <= {limit:.3g}")
    if budget.rtol is not None:
        rule = f"|t - r| <= {budget.atol:g} + {budget.rtol:g} * |r|"
        if outside_close is None:
            return Verdict.WARN, (f"{rule} not checked: this pair has statistics only (capture with --mode full) "
                                  f"({budget.source})")
        if outside_close > budget.close_share:
            return Verdict.FAIL, f"{outside_close:.3%} of elements outside {rule} (allowed {budget.close_share:.3%}, {budget.source})"
        said.append(f"{outside_close:.3%} of elements outside {rule}")
    return Verdict.PASS, "; ".join(said) + f" ({budget.source})"


def judge_golden(target: Metrics, reference: Metrics, budget: Budget) -> tuple[str, str, float]:
    """Golden mode: both sides against the fp64 recomputation; returns (verdict, reason, ratio).

    The target passes when its error is within its dtype budget, or within ``GOLDEN_RATIO``
    times the reference's own error (so a reference's rounding is not blamed on the target).
    """
    bad = nonfinite_reason(target)
    t_err, r_err = target.norm_l2, reference.norm_l2
    ratio = t_err / r_err if r_err > 0 else (1.0 if t_err == 0 else float("inf"))
    if bad:
        return Verdict.FAIL, bad + " (vs fp64 golden)", ratio
    allowed = max(budget.norm_l2, GOLDEN_RATIO * r_err)
    words = (f"norm L2 err vs fp64 golden {t_err:.1e} = {ratio:.3g}x the reference's {r_err:.1e} "
             f"(allowed {GOLDEN_RATIO:g}x, or budget {budget.norm_l2:.1e} {budget.source})")
    if t_err <= allowed:
        return Verdict.PASS, words, ratio
    if t_err <= allowed * WARN_FACTOR:
        return Verdict.WARN, words, ratio
    return Verdict.FAIL, words, ratio


def judge_bands(checks: Sequence[BandCheck], significant: bool, n_tested: int) -> tuple[str, str]:
    """Verdict of one op against its bands; ``significant`` is the FDR decision across ops."""
    out = [c for c in checks if c.out]
    if not out:
        c = max(checks, key=lambda c: c.value / c.band.upper if c.band.upper > 0 else 0.0)
        return Verdict.PASS, f"{label(c.band.metric)} {c.value:.1e} <= band {c.band.upper:.1e} ({c.band.describe()})"
    c = min(out, key=lambda c: c.p_value)
    words = f"{label(c.band.metric)} {c.value:.1e} > band {c.band.upper:.1e} ({c.band.describe()}), p={c.p_value:.1e}"
    if significant:
        return Verdict.FAIL, words
    return Verdict.WARN, words + f", not significant after FDR control over {n_tested} ops"


def judge_nonfinite_history(m: Metrics, runs: int, nonfinite: int) -> tuple[str, str] | None:
    """NaN/Inf as an outcome of its own against history; None when finite as usual."""
    bad = nonfinite_reason(m)
    if bad is None:
        if runs and nonfinite * 2 > runs:
            return Verdict.WARN, f"finite where {nonfinite} of {runs} accepted runs had a NaN/Inf mismatch (fixed?)"
        return None
    if nonfinite == 0:
        return Verdict.FAIL, f"{bad}; never seen in {runs} accepted runs"
    if nonfinite * 2 >= runs:
        return Verdict.PASS, f"{bad}, as in {nonfinite} of {runs} accepted runs"
    return Verdict.WARN, f"{bad}; seen in only {nonfinite} of {runs} accepted runs"
