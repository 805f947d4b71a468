"""Replies of the dashboard's JSON endpoints (``api/routes/dashboard.py``), named by role."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from api.schemas import ComparisonPublic, EnvironmentChange, OpResultPublic, RegressionPublic, Timestamp


class RunSide(BaseModel):
    """One side of a comparison as a person names it: label, target, device, variant, tags."""

    bundle_id: str
    label: str | None
    target: str = Field(description="the run's target name, else variant@device")
    variant: str
    device: str
    git_branch: str | None
    git_commit: str | None
    tags: dict[str, Any] = Field(default_factory=dict)
    created_at: Timestamp


class EnvironmentChangeCategorized(EnvironmentChange):
    category: str = Field(description="torch, driver, op library, threads, flags, inputs, dtype, device, capture, "
                                      "code or other")


class ComparisonRuns(BaseModel):
    """A comparison's header: both runs and what changed between their environments."""

    project: str
    comparison: ComparisonPublic
    reference: RunSide
    target: RunSide
    changed: list[EnvironmentChangeCategorized]
    same: int
    categories: list[str] = Field(description="the categories that changed, e.g. ['dtype', 'threads']")


class OpGroup(BaseModel):
    """An op of a comparison and, when it is a local failure, the inherited failures that follow from it."""

    op: OpResultPublic
    inherited: list[OpResultPublic] = Field(default_factory=list)
    inherited_count: int = 0


class OpGroups(BaseModel):
    data: list[OpGroup]
    count: int
    folded: bool


class TargetStatus(BaseModel):
    """The latest finished comparison of one target."""

    target: str
    comparison_id: str
    verdict: str | None
    counts: dict[str, Any]
    label: str | None = Field(description="the target run's label")
    tags: dict[str, Any] = Field(default_factory=dict, description="the target run's tags")
    first_divergence: str | None
    created_at: Timestamp
    runs: int = Field(description="runs (bundles) uploaded under this target name")


class Overview(BaseModel):
    project: str
    public: bool
    targets: list[TargetStatus]
    open_regressions: int
    regressions: list[RegressionPublic]
    recent: list[ComparisonPublic]
    comparisons: int


class HistoryPoint(BaseModel):
    comparison_id: str
    created_at: Timestamp
    label: str | None
    value: float | None = Field(description="null where the metric is not finite (see verdict)")
    verdict: str
    budget: float | None = Field(description="the budget that bounded this metric in this comparison")
    band: float | None = Field(description="upper (cosine: lower) end of the band learned from the runs accepted "
                                           "before this one; null with too little history")
    band_runs: int = Field(description="accepted runs the band was learned from")
    out: bool = Field(description="out of band or over budget (verdict warn or fail)")
    accepted_in: list[str] = Field(description="baselines this comparison was promoted into")


class HistorySeries(BaseModel):
    target: str
    shape_signature: str
    dtype: str
    metric: str
    points: list[HistoryPoint]
    regression: RegressionPublic | None


class AcceptedRun(BaseModel):
    comparison_id: str
    baseline: str
    added_at: Timestamp
    target: str
    shape_signature: str
    verdict: str
    value: float | None


class OpHistory(BaseModel):
    key: str
    op: str | None
    metric: str
    targets: list[str] = Field(description="every target name this op has results for (the target filter's choices)")
    series: list[HistorySeries]
    accepted_in: list[AcceptedRun]


class HistogramBin(BaseModel):
    low: float
    high: float | None = Field(description="null: the overflow bin")
    count: int


class OpDetail(BaseModel):
    """One op in one comparison: its metrics, error histogram and both sides' statistics."""

    comparison: ComparisonPublic
    result: OpResultPublic
    histogram: list[HistogramBin] = Field(description="non-empty bins of |target - reference|; low 0, high 0: "
                                                      "exact zeros")
    quantiles: dict[str, float | str]
    reference_stats: dict[str, Any] | None
    target_stats: dict[str, Any] | None


class HeatmapRun(BaseModel):
    comparison_id: str
    created_at: Timestamp
    target: str
    label: str | None
    verdict: str | None


class HeatmapOp(BaseModel):
    key: str
    op: str
    index: int


class Heatmap(BaseModel):
    metric: str
    runs: list[HeatmapRun]
    ops: list[HeatmapOp]
    z: list[list[float | None]] = Field(description="z[op][run]; severity is capped at 1000 (non-finite outcomes)")
    verdicts: list[list[str | None]]


class RegressionEventPublic(BaseModel):
    model_config = {"from_attributes": True}
    id: int
    regression_id: int
    key: str
    target: str
    status: str
    actor: str
    note: str | None
    deviation_id: int | None
    expires_at: Timestamp | None
    at: Timestamp
