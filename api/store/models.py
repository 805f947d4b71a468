"""The data model (SQLAlchemy 2 typed ORM). The schema itself is made only by alembic migrations."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, LargeBinary, String, Text, UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


def aware(dt: datetime) -> datetime:
    """``dt`` in UTC when it carries no zone (SQLite hands stored datetimes back naive)."""
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Project(Base):
    __tablename__ = "projects"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Token(Base):
    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    read_only: Mapped[bool] = mapped_column(Boolean, default=False)
    name: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class BundleRow(Base):
    __tablename__ = "bundles"
    __table_args__ = (UniqueConstraint("project_id", "sha256", name="uq_bundles_project_sha"),
                      Index("ix_bundles_project_target", "project_id", "target"))
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    storage_key: Mapped[str] = mapped_column(String(500))
    label: Mapped[str | None] = mapped_column(String(200))
    variant: Mapped[str] = mapped_column(String(40), default="fp32")
    device: Mapped[str] = mapped_column(String(100), default="cpu")
    #: the target name its series and regressions are kept under: ``run.target`` or ``variant@device``
    target: Mapped[str] = mapped_column(String(200))
    #: free-form ``key: value`` tags (branch, commit, CANN/driver version, op-library version)
    tags: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    level: Mapped[str | None] = mapped_column(String(20))
    mode: Mapped[str | None] = mapped_column(String(20))
    git_commit: Mapped[str | None] = mapped_column(String(64))
    git_branch: Mapped[str | None] = mapped_column(String(200))
    records: Mapped[int] = mapped_column(Integer, default=0)
    run: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    environment: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class OpRecordRow(Base):
    """Index of the records a bundle holds (the tensors stay in the blob)."""

    __tablename__ = "op_records"
    __table_args__ = (Index("ix_op_records_bundle_key", "bundle_id", "key"),)
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    bundle_id: Mapped[str] = mapped_column(ForeignKey("bundles.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(1000))
    output: Mapped[int] = mapped_column(Integer, default=0)
    op: Mapped[str] = mapped_column(String(200))
    module: Mapped[str] = mapped_column(String(800))
    kind: Mapped[str] = mapped_column(String(20))
    index: Mapped[int] = mapped_column(Integer)
    shape_signature: Mapped[str] = mapped_column(String(1000))
    dtype: Mapped[str] = mapped_column(String(40))


class Comparison(Base):
    """A comparison job and its outcome."""

    __tablename__ = "comparisons"
    __table_args__ = (Index("ix_comparisons_project_created", "project_id", "created_at"),
                      Index("ix_comparisons_status_lease", "status", "lease_until"))
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    reference_id: Mapped[str] = mapped_column(ForeignKey("bundles.id"))
    target_id: Mapped[str] = mapped_column(ForeignKey("bundles.id"))
    mode: Mapped[str] = mapped_column(String(20), default="propagated")
    status: Mapped[str] = mapped_column(String(20), default="pending")
    verdict: Mapped[str | None] = mapped_column(String(20))
    counts: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    first_divergence: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: both runs generated: the token-level comparison per step (``GenerationComparison.as_dict``)
    generation: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    unmatched: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: sharded comparisons (``api.jobs.shards``): how many shards (before the split: a requested count, or
    #: None to decide by size), how many are judged (None before the split), and what every shard and the
    #: merge re-plan from (pair count and digest, the accepted comparisons whose history judges it)
    shards: Mapped[int | None] = mapped_column(Integer)
    shards_done: Mapped[int | None] = mapped_column(Integer)
    shard_plan: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    reference: Mapped[BundleRow] = relationship(foreign_keys=[reference_id], lazy="joined")
    target: Mapped[BundleRow] = relationship(foreign_keys=[target_id], lazy="joined")


class ComparisonShard(Base):
    """One contiguous range of a sharded comparison's aligned pairs: a job of its own on the same queue
    (claim, lease, retry), whose judged ops are kept (zlib-compressed JSON) until the merge."""

    __tablename__ = "comparison_shards"
    __table_args__ = (UniqueConstraint("comparison_id", "index", name="uq_comparison_shards_index"),
                      Index("ix_comparison_shards_status_lease", "status", "lease_until"))
    id: Mapped[str] = mapped_column(String(48), primary_key=True)  # "<comparison id>:<index>"
    comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    start: Mapped[int] = mapped_column(Integer)
    stop: Mapped[int] = mapped_column(Integer)
    tensor_bytes: Mapped[int] = mapped_column(BigInteger)  # of both sides: what the ranges balance
    status: Mapped[str] = mapped_column(String(20), default="pending")
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    results: Mapped[bytes | None] = mapped_column(LargeBinary)


class Series(Base):
    """One drift line: (op key, input shapes, dtype, target name) within a project."""

    __tablename__ = "series"
    __table_args__ = (UniqueConstraint("project_id", "key", "shape_signature", "dtype", "target", name="uq_series"),
                      Index("ix_series_project_worst", "project_id", "worst_severity"))
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(1000))
    op: Mapped[str] = mapped_column(String(200))
    shape_signature: Mapped[str] = mapped_column(String(1000))
    dtype: Mapped[str] = mapped_column(String(40))
    target: Mapped[str] = mapped_column(String(200))  # the target bundle's target name (BundleRow.target)
    #: the worst severity any result of this series had: the drift view's "worst first" without a scan
    worst_severity: Mapped[float | None] = mapped_column(Float)


class OpResultRow(Base):
    __tablename__ = "op_results"
    __table_args__ = (
        Index("ix_op_results_comparison_verdict", "comparison_id", "verdict"),
        Index("ix_op_results_series_created", "series_id", "created_at"),
    )
    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    series_id: Mapped[int | None] = mapped_column(ForeignKey("series.id", ondelete="SET NULL"))
    key: Mapped[str] = mapped_column(String(1000))
    output: Mapped[int] = mapped_column(Integer, default=0)
    op: Mapped[str] = mapped_column(String(200))
    module: Mapped[str] = mapped_column(String(800))
    kind: Mapped[str] = mapped_column(String(20))
    index: Mapped[int] = mapped_column(Integer)
    shape_signature: Mapped[str] = mapped_column(String(1000))
    dtype: Mapped[str] = mapped_column(String(40))
    verdict: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str] = mapped_column(Text)
    inherited: Mapped[bool] = mapped_column(Boolean, default=False)
    severity: Mapped[float | None] = mapped_column(Float)
    norm_l2: Mapped[float | None] = mapped_column(Float)
    max_abs: Mapped[float | None] = mapped_column(Float)
    max_rel: Mapped[float | None] = mapped_column(Float)
    cosine: Mapped[float | None] = mapped_column(Float)
    snr_db: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    budget: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    @property
    def nonfinite(self) -> bool:
        """NaN/Inf where the reference differs: the finite-part metrics then understate the error."""
        m = self.metrics or {}
        return bool(m.get("nan_mismatch") or m.get("inf_mismatch") or m.get("nan_where_ref_finite"))


class Baseline(Base):
    """A named set of accepted comparisons (e.g. per branch) that bands are learned from."""

    __tablename__ = "baselines"
    __table_args__ = (UniqueConstraint("project_id", "name", name="uq_baselines_project_name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class BaselineMember(Base):
    __tablename__ = "baseline_members"
    baseline_id: Mapped[int] = mapped_column(ForeignKey("baselines.id", ondelete="CASCADE"), primary_key=True)
    comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"), primary_key=True)
    added_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AcceptedDeviation(Base):
    """A known, accepted out-of-band op: silences its regression until it expires."""

    __tablename__ = "accepted_deviations"
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    key_pattern: Mapped[str] = mapped_column(String(1000))
    shape_signature: Mapped[str | None] = mapped_column(String(1000))
    reason: Mapped[str] = mapped_column(Text)
    author: Mapped[str] = mapped_column(String(200))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Regression(Base):
    """An op (key + input shapes + dtype + target) that went out of band."""

    __tablename__ = "regressions"
    __table_args__ = (Index("ix_regressions_project_status", "project_id", "status"),
                      Index("ix_regressions_project_updated", "project_id", "updated_at"))
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id", ondelete="CASCADE"), unique=True)
    key: Mapped[str] = mapped_column(String(1000))
    op: Mapped[str] = mapped_column(String(200))
    shape_signature: Mapped[str] = mapped_column(String(1000))
    status: Mapped[str] = mapped_column(String(20), default="active")
    first_comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    last_comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    reason: Mapped[str] = mapped_column(Text)
    # the accepted deviation that put it in status "accepted" (None: a person set the status):
    # when that deviation expires or is deleted, the next failure opens the regression again
    accepted_by: Mapped[int | None] = mapped_column(
        ForeignKey("accepted_deviations.id", ondelete="SET NULL", name="fk_regressions_accepted_by"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    series: Mapped[Series] = relationship(lazy="joined")  # loaded with the row: its dtype and target

    @property
    def dtype(self) -> str:
        return self.series.dtype

    @property
    def target(self) -> str:
        return self.series.target


class RegressionEvent(Base):
    """The audit of one decision about a regression: who did what, when (acknowledge, accept, re-open)."""

    __tablename__ = "regression_events"
    __table_args__ = (Index("ix_regression_events_project_at", "project_id", "at"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    regression_id: Mapped[int] = mapped_column(ForeignKey("regressions.id", ondelete="CASCADE"), index=True)
    status: Mapped[str] = mapped_column(String(20))  # the status it was set to
    actor: Mapped[str] = mapped_column(String(200))  # the author given, else the token's name, else "anonymous"
    note: Mapped[str | None] = mapped_column(Text)
    deviation_id: Mapped[int | None] = mapped_column(Integer)  # the accepted deviation behind it (kept if deleted)
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
