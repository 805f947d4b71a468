"""Response and request schemas, named by role (``BundlePublic``, ``BundlesPublic{data, count}``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

T = TypeVar("T")


def _utc(v: datetime) -> datetime:
    """SQLite hands back naive datetimes (stored in UTC): every reply says so, as PostgreSQL's do."""
    return v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)


#: A timestamp in replies: always timezone-aware UTC, serialized as ``2026-12-01T10:37:55Z``.
Timestamp = Annotated[datetime, AfterValidator(_utc)]


class RequestBody(BaseModel):
    """Every JSON request body: unknown fields refused, and no NUL character in any string (no database
    column can hold one), checked here once for all routes."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _no_nul(cls, v: Any) -> Any:
        if isinstance(v, str) and "\x00" in v:
            raise ValueError("contains a NUL character (\\u0000): remove it")
        return v


class ErrorPublic(BaseModel):
    """Every error answer: what went wrong and what to do next."""

    detail: str


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ValidationErrorPublic(ErrorPublic):
    """422: ``detail`` joins the problems into one sentence; ``errors`` lists them (never the input)."""

    errors: list[FieldError] = Field(default_factory=list)


class Page(BaseModel, Generic[T]):
    data: list[T]
    count: int


class ProjectPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    name: str
    public: bool
    created_at: Timestamp


class BundlePublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: str
    sha256: str
    size: int
    label: str | None
    variant: str
    device: str
    target: str = Field(description="target name its series are kept under: the run's --target, else variant@device")
    tags: dict[str, Any] = Field(default_factory=dict, description="free-form tags: branch, commit, cann, driver ...")
    level: str | None
    mode: str | None
    git_commit: str | None
    git_branch: str | None
    records: int
    created_at: Timestamp


class BundleDetail(BundlePublic):
    run: dict[str, Any]
    environment: dict[str, Any]


class ComparisonCreate(RequestBody):
    reference: str = Field(min_length=1, max_length=64, description="bundle id of the reference run")
    target: str = Field(min_length=1, max_length=64, description="bundle id of the target run")
    mode: Literal["propagated", "replay", "golden"] = "propagated"
    shards: int | None = Field(default=None, ge=1, le=4096, description=(
        "split the comparison into this many op ranges, judged by any free workers and merged into one "
        "result (1: never split); default: split only bundles over OPBAND_SHARD_BYTES of tensors"))


class RunSummary(BaseModel):
    """One side of a comparison as a person names it."""

    model_config = ConfigDict(from_attributes=True)
    id: str
    label: str | None
    target: str = Field(description="target name: the run's --target, else variant@device")
    variant: str
    device: str
    tags: dict[str, Any] = Field(default_factory=dict)
    git_commit: str | None = None
    git_branch: str | None = None


class ComparisonPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: str
    reference_id: str
    target_id: str
    mode: str
    status: str
    verdict: str | None
    counts: dict[str, Any]
    first_divergence: dict[str, Any] | None
    generation: dict[str, Any] | None = Field(default=None, description="both runs generated: per step (0 the "
                                              "prefill) argmax agreement, top-k overlap, log-prob drop, KL, tokens")
    unmatched: int
    error: str | None
    attempts: int
    shards: int | None = Field(default=None, description="op ranges the comparison was split into (null: not yet decided)")
    shards_done: int | None = Field(default=None, description="how many of them are judged")
    created_at: Timestamp
    started_at: Timestamp | None
    finished_at: Timestamp | None
    target_variant: str | None = None
    target_device: str | None = None
    reference_run: RunSummary | None = None
    target_run: RunSummary | None = Field(default=None, description="its target name keys the series and regressions")


#: Stored in place of an infinite severity, so that SQL sorts such failures first (not as NULL, last).
SEVERITY_INF = 1e300


class OpResultPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    key: str
    op: str
    module: str
    kind: str
    index: int
    shape_signature: str
    dtype: str
    verdict: str
    reason: str
    inherited: bool
    severity: float | str | None = Field(description='value / limit of the worst metric; "inf" for a non-finite '
                                                     "outcome (NaN/Inf where the reference is finite, shape mismatch)")
    norm_l2: float | None
    max_abs: float | None
    max_rel: float | None
    cosine: float | None
    snr_db: float | None
    nonfinite: bool = Field(default=False, description="NaN/Inf where the reference differs (the metrics above "
                                                        "cover the elements finite on both sides)")
    metrics: dict[str, Any] | None = None
    budget: dict[str, Any] | None = None

    @field_validator("severity", mode="before")
    @classmethod
    def _infinite(cls, v: Any) -> Any:
        return "inf" if isinstance(v, (int, float)) and v >= SEVERITY_INF else v


class RegressionPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    key: str
    op: str
    shape_signature: str
    status: str
    reason: str
    first_comparison_id: str
    last_comparison_id: str
    dtype: str
    target: str = Field(description="target name of the series: the target run's --target (e.g. ascend-910b/bf16), "
                                    "else its variant@device (e.g. bf16@cpu)")
    accepted_by: int | None = None  # the accepted deviation behind status "accepted", if any
    created_at: Timestamp
    updated_at: Timestamp


class TargetPublic(BaseModel):
    """A target name of a project: how many runs it has and its latest finished comparison."""

    target: str
    bundles: int
    last_upload: Timestamp
    latest_comparison_id: str | None = None
    latest_verdict: str | None = None
    latest_label: str | None = None


class DriftPoint(BaseModel):
    comparison_id: str
    created_at: Timestamp
    value: float | None = Field(description="null where the metric is not finite (see verdict)")
    verdict: str
    budget: float | None

    @field_validator("value", mode="before")
    @classmethod
    def _plot_gap(cls, v: Any) -> Any:
        return None if isinstance(v, (int, float)) and abs(v) >= SEVERITY_INF else v


class DriftSeries(BaseModel):
    key: str
    shape_signature: str
    dtype: str
    target: str
    metric: str
    points: list[DriftPoint]


class ProjectUpdate(RequestBody):
    public: bool = Field(description="public projects can be read without a token")


class BaselineCreate(RequestBody):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)*$",
                      description="e.g. the branch name: main, release/2.4, feature/int8-kv (segments joined by "
                                  "'/', each starting with a letter or digit)")

    @field_validator("name")
    @classmethod
    def _not_a_route(cls, v: str) -> str:
        if v.rsplit("/", 1)[-1] == "comparisons" or ".." in v:
            raise ValueError("a baseline name may not contain '..' or end in '/comparisons' (that is the route "
                             "that promotes comparisons into it)")
        return v


class BaselinePromote(RequestBody):
    comparison: str = Field(min_length=1, max_length=64, description="id of a finished comparison to accept into the baseline")
    force: bool = Field(default=False, description="also accept a comparison whose verdict is fail")


class BaselinePublic(BaseModel):
    name: str
    created_at: Timestamp
    comparisons: list[str]


class DeviationCreate(RequestBody):
    key_pattern: str = Field(min_length=1, max_length=1000, description="op key glob, e.g. model.layers.*/aten.mm#0")
    shape_signature: str | None = Field(default=None, max_length=1000, description="only these input shapes")
    reason: str = Field(min_length=1, max_length=4000, description="why this deviation is acceptable")
    author: str = Field(min_length=1, max_length=200)
    expires_at: datetime | None = Field(default=None, description="after this the deviation no longer applies")


class DeviationPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)
    id: int
    key_pattern: str
    shape_signature: str | None
    reason: str
    author: str
    expires_at: Timestamp | None
    created_at: Timestamp
    accepted_regressions: int = 0


class RegressionUpdate(RequestBody):
    status: Literal["active", "acknowledged", "accepted", "resolved"]
    author: str | None = Field(default=None, max_length=200, description="who decided (kept in the regression's audit)")
    note: str | None = Field(default=None, max_length=4000, description="why (kept in the audit)")


class EnvironmentChange(BaseModel):
    field: str
    a: Any
    b: Any


class BundleDiff(BaseModel):
    a: str
    b: str
    changed: list[EnvironmentChange]
    same: int = Field(description="how many compared fields are equal")
