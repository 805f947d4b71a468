"""What a comparison finds: one op's result (:class:`OpResult`) and the whole report (:class:`ComparisonReport`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from accuracy.align import Unmatched
from accuracy.bands import BandCheck
from accuracy.budgets import Budget
from accuracy.fingerprints import ParameterDifference
from accuracy.capture_format import step_of_key
from accuracy.generation import GenerationComparison
from accuracy.manifest import shape_signature
from accuracy.metrics import Metrics
from accuracy.verdicts import TABLE_ORDER, Verdict


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
    verdict: Verdict
    reason: str
    budget: Budget | None = None
    aligned_by: str = "key"
    inherited: bool = False
    bands: list[BandCheck] = field(default_factory=list)  # non-empty when judged against history
    p_value: float | None = None  # band mode: Bonferroni over the op's metrics, before FDR control
    reference_metrics: Metrics | None = None  # golden mode: the reference against the golden
    golden_ratio: float | None = None  # golden mode: target error / reference error
    finding: str | None = None  # e.g. a precision trap: "computed in bfloat16, reference float32, run declared fp32"
    auxiliary: str | None = None  # what a by-product output is ("saved mean", "indices"): reported, never failing alone
    layouts: tuple[str, str] | None = None  # (reference, target) memory layouts when they differ

    @property
    def id(self) -> str:
        return self.key if self.output == 0 else f"{self.key}:{self.output}"

    @property
    def shape_signature(self) -> str:
        return shape_signature(self.input_shapes)

    @property
    def step(self) -> int:
        """The step of a capture whose calls of the model are steps (a generation: 0 the prefill, then
        one per decode step); 0 otherwise."""
        return step_of_key(self.key)

    @property
    def error(self) -> float:
        """The op's normalized L2 error (inf when it has no metrics but failed)."""
        if self.metrics is None:
            return math.inf if self.verdict == Verdict.FAIL else 0.0
        return self.metrics.norm_l2

    @property
    def severity(self) -> float:
        """How far out of its band or budget this op is (value / limit); orders tables worst first."""
        if self.metrics is None:
            return math.inf if self.verdict == Verdict.FAIL else 0.0
        if not self.metrics.finite_outcome:
            return math.inf
        if self.bands:
            return max(c.value / c.band.upper if c.band.upper > 0 else math.inf for c in self.bands)
        if self.budget is None:
            return 0.0
        if self.budget.limits and math.isinf(self.budget.norm_l2):  # an override of other metrics only
            return max((self.metrics.get(name) / limit if limit > 0 else math.inf
                        for name, limit in self.budget.limits), default=0.0)
        if self.budget.norm_l2 == 0:
            return math.inf if self.metrics.norm_l2 > 0 or self.metrics.mismatches else 0.0
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
    verdict: Verdict
    counts: dict[str, int] = field(default_factory=dict)
    golden: dict[str, Any] | None = None
    history: dict[str, Any] | None = None
    parameters: list[ParameterDifference] = field(default_factory=list)  # parameters that differ: findings
    notes: list[str] = field(default_factory=list)  # what was not judged, and why
    passes_not_listed: int = 0  # a large comparison lists its passing ops only in ``counts``
    generation: GenerationComparison | None = None  # both runs generated: their tokens step by step

    @property
    def total_ops(self) -> int:
        """Every judged op and unmatched record, listed in ``ops`` or not."""
        return len(self.ops) + self.passes_not_listed

    def __bool__(self) -> bool:
        return self.verdict != Verdict.FAIL

    @property
    def first_gradient_divergence(self) -> OpResult | None:
        """The earliest out-of-budget gradient or parameter update (training captures), in backward order."""
        bad = [o for o in self.ops if o.kind == "grad" and o.verdict in (Verdict.FAIL, Verdict.WARN) and o.aligned_by != "none"]
        return min(bad, key=lambda o: o.index) if bad else None

    def worst_first(self) -> list[OpResult]:
        return sorted(self.ops, key=lambda o: (-TABLE_ORDER.index(o.verdict), o.inherited, -o.severity, o.index))
