"""Read queries behind the dashboard pages: overview, comparison header, folded ops, op history, heatmap, audit."""

from __future__ import annotations

import math
from collections import defaultdict
from functools import lru_cache
from typing import Any

import numpy as np
from accuracy.verdicts import Verdict
from sqlalchemy import func, select
from sqlalchemy.orm import aliased

from accuracy.bands import BandConfig, fit_band
from accuracy.bundle import Bundle
from accuracy.envdiff import category_of
from accuracy.errors import OpbandError
from accuracy.metrics import slot_bounds
from api.dashboard_schemas import (
    AcceptedRun, ComparisonRuns, EnvironmentChangeCategorized, Heatmap, HeatmapOp, HeatmapRun, HistogramBin,
    HistoryPoint, HistorySeries, OpDetail, OpGroup, OpHistory, Overview, RegressionEventPublic, RunSide, TargetStatus,
)
from api.errors import InvalidInput, NotFound
from api.schemas import SEVERITY_INF, ComparisonPublic, EnvironmentChange, OpResultPublic, RegressionPublic, RunSummary
from api.store.blobs import BlobStore
from api.store.db import Database
from api.store.models import (
    Baseline, BaselineMember, BundleRow, Comparison, OpResultRow, Project, Regression, RegressionEvent, Series,
)
from api.store import queries
from api.store.queries import BAND_OF_METRIC, METRIC_COLUMNS, bundle_diff

SEVERITY_CAP = 1000.0
HEATMAP_ORDERS = ("execution", "similar")  # heatmap colour of non-finite outcomes (stored as SEVERITY_INF)


def run_side(bundle: BundleRow) -> RunSide:
    return RunSide(bundle_id=bundle.id, label=bundle.label, target=bundle.target, variant=bundle.variant,
                   device=bundle.device, git_branch=bundle.git_branch, git_commit=bundle.git_commit,
                   tags=bundle.tags or {}, created_at=bundle.created_at)


def comparison_public(c: Comparison) -> ComparisonPublic:
    """As ``GET /comparisons/{id}`` answers: both runs named (label, target name, tags)."""
    out = ComparisonPublic.model_validate(c)
    out.target_variant, out.target_device = c.target.variant, c.target.device
    out.reference_run, out.target_run = RunSummary.model_validate(c.reference), RunSummary.model_validate(c.target)
    return out


def _tag_changes(a: BundleRow, b: BundleRow) -> list[EnvironmentChange]:
    """Tags the two runs were given (CANN or driver version, op-library version ...) that differ."""
    ta, tb = a.tags or {}, b.tags or {}
    return [EnvironmentChange(field=f"tags.{k}", a=ta.get(k), b=tb.get(k))
            for k in sorted(set(ta) | set(tb)) if ta.get(k) != tb.get(k)]


def comparison_runs(db: Database, c: Comparison) -> ComparisonRuns:
    """Both runs of a comparison and every environment field that differs, with its category."""
    with db.session() as s:
        project = s.get(Project, c.project_id)
    assert project is not None
    diff = bundle_diff(c.reference, c.target)
    changed = [EnvironmentChangeCategorized(**ch.model_dump(), category=category_of(ch.field))
               for ch in [*diff.changed, *_tag_changes(c.reference, c.target)]]
    categories = sorted({ch.category for ch in changed if ch.category != "code"})
    return ComparisonRuns(project=project.name, comparison=comparison_public(c), reference=run_side(c.reference), target=run_side(c.target),
                          changed=changed, same=diff.same, categories=categories)


def op_groups(db: Database, comparison_id: str, roots: list[OpResultRow], fold: bool,
              per_root: int = 100) -> list[OpGroup]:
    """Each op; with ``fold``, each local failure with the inherited failures it carries downstream: those
    after it in execution order and before the next local failure (the first divergence's error flows forward)."""
    if not fold:
        groups = [OpGroup(op=OpResultPublic.model_validate(r)) for r in roots]
        for g in groups:
            g.op.metrics = None
        return groups
    with db.session() as s:
        local_bad = list(s.scalars(select(OpResultRow.index).where(
            OpResultRow.comparison_id == comparison_id, OpResultRow.inherited.is_(False),
            OpResultRow.verdict.in_(("fail", "warn"))).order_by(OpResultRow.index)))
        out = []
        for r in roots:
            group = OpGroup(op=OpResultPublic.model_validate(r))
            if r.verdict in (Verdict.FAIL, Verdict.WARN) and not r.inherited:
                later = [i for i in local_bad if i > r.index]
                q = select(OpResultRow).where(OpResultRow.comparison_id == comparison_id,
                                              OpResultRow.inherited.is_(True), OpResultRow.index > r.index)
                if later:
                    q = q.where(OpResultRow.index < later[0])
                group.inherited_count = s.scalar(select(func.count()).select_from(q.subquery())) or 0
                group.inherited = [OpResultPublic.model_validate(x)
                                   for x in s.scalars(q.order_by(OpResultRow.index).limit(per_root))]
            out.append(group)
    for g in out:
        for o in [g.op, *g.inherited]:
            o.metrics = None
    return out


def overview(db: Database, project: Project, recent: int = 10) -> Overview:
    """Targets x their latest verdict, open regressions and the most recent comparisons of a project."""
    targets = [t for t in queries.targets(db, project) if t.latest_comparison_id]  # target names that were compared
    latest = {t.target: queries.get_comparison(db, t.latest_comparison_id) for t in targets if t.latest_comparison_id}
    rows, total = queries.list_comparisons(db, project, recent, 0)
    with db.session() as s:
        open_q = select(Regression).where(Regression.project_id == project.id,
                                          Regression.status.in_(("active", "acknowledged")))
        n_open = s.scalar(select(func.count()).select_from(open_q.subquery())) or 0
        regs = list(s.scalars(open_q.order_by(Regression.updated_at.desc()).limit(10)))
    status = [TargetStatus(target=t.target, comparison_id=c.id, verdict=c.verdict, counts=c.counts or {},
                           label=c.target.label, tags=c.target.tags or {},
                           first_divergence=(c.first_divergence or {}).get("key"), created_at=c.created_at, runs=t.bundles)
              for t in targets for c in [latest[t.target]]]
    return Overview(project=project.name, public=project.public, targets=status, open_regressions=n_open,
                    regressions=[RegressionPublic.model_validate(r) for r in regs],
                    recent=[comparison_public(c) for c in rows], comparisons=total)


def _finite(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) or abs(v) >= SEVERITY_INF else float(v)


def op_history(db: Database, project: Project, key: str, metric: str, target: str | None,
               points: int = 200) -> OpHistory:
    """An op key's metric per target series, each point with its budget, the band learned from the runs
    accepted before it, and the baselines it was promoted into; and the runs the op was accepted in."""
    if metric not in METRIC_COLUMNS or metric == "severity":
        raise InvalidInput(f"metric must be one of {sorted(set(METRIC_COLUMNS) - {'severity'})}, not {metric!r}")
    col = METRIC_COLUMNS[metric]
    banded = metric in BandConfig().metrics
    tgt = aliased(BundleRow)
    with db.session() as s:
        sq = select(Series).where(Series.project_id == project.id, Series.key == key)
        if target:
            sq = sq.where(Series.target == target)
        series = list(s.scalars(sq.order_by(Series.target, Series.shape_signature)))
        targets = list(s.scalars(select(Series.target).where(Series.project_id == project.id, Series.key == key)
                                 .distinct().order_by(Series.target)))
        if not series:
            raise NotFound(f"op {key!r} has no results in project {project.name!r}"
                           + (f" for target {target!r}" if target else ""))
        members: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        for cid, name, added in s.execute(select(BaselineMember.comparison_id, Baseline.name, BaselineMember.added_at)
                                          .join(Baseline, Baseline.id == BaselineMember.baseline_id)
                                          .where(Baseline.project_id == project.id)):
            members[cid].append((name, added))
        regs = {r.series_id: r for r in s.scalars(select(Regression).where(
            Regression.series_id.in_([x.id for x in series])))}
        out, accepted_in = [], []
        for ser in series:
            rows = s.execute(
                select(OpResultRow.comparison_id, OpResultRow.created_at, col, OpResultRow.verdict,
                       OpResultRow.budget, tgt.label)
                .join(Comparison, Comparison.id == OpResultRow.comparison_id)
                .join(tgt, tgt.id == Comparison.target_id)
                .where(OpResultRow.series_id == ser.id)
                .order_by(OpResultRow.created_at.desc()).limit(points)).all()
            rows.reverse()
            history: list[float] = []  # accepted values so far, oldest first
            pts = []
            for cid, created, value, verdict, budget, label in rows:
                band = fit_band(history, metric, ser.dtype) if banded else None
                pts.append(HistoryPoint(
                    comparison_id=cid, created_at=created, label=label, value=_finite(value), verdict=verdict,
                    budget=(budget or {}).get(BAND_OF_METRIC.get(metric, "")), band=band.upper if band else None,
                    band_runs=band.n if band else len([h for h in history if math.isfinite(h)]),
                    out=verdict in (Verdict.FAIL, Verdict.WARN), accepted_in=[n for n, _ in members.get(cid, [])]))
                if cid in members and value is not None:
                    history.append(float(value))
                for name, added in members.get(cid, []):
                    accepted_in.append(AcceptedRun(comparison_id=cid, baseline=name, added_at=added, target=ser.target,
                                                   shape_signature=ser.shape_signature, verdict=verdict,
                                                   value=_finite(value)))
            reg = regs.get(ser.id)
            out.append(HistorySeries(target=ser.target, shape_signature=ser.shape_signature, dtype=ser.dtype,
                                     metric=metric, points=pts,
                                     regression=RegressionPublic.model_validate(reg) if reg else None))
    accepted_in.sort(key=lambda a: a.added_at, reverse=True)
    return OpHistory(key=key, op=series[0].op, metric=metric, targets=targets, series=out, accepted_in=accepted_in)


def histogram_bins(histogram: list[int]) -> list[HistogramBin]:
    """The non-empty slots of a stored log-binned |error| histogram, with their bounds."""
    bins = []
    for i, n in enumerate(histogram):
        if n:
            lo, hi = slot_bounds(i)
            bins.append(HistogramBin(low=lo, high=hi if math.isfinite(hi) else None, count=int(n)))
    return bins


@lru_cache(maxsize=64)
def _record_stats(store: BlobStore, storage_key: str) -> dict[str, dict[str, Any]]:
    """Each record's statistics in one stored bundle (its manifest; tensors only where it has none)."""
    out: dict[str, dict[str, Any]] = {}
    with store.local_path(storage_key) as path:
        bundle = Bundle.open(path)
        for r in bundle.records:
            if r.stats is not None:
                out[r.id] = r.stats.model_dump(exclude={"sample"}, exclude_none=True)
            elif r.tensor is not None:
                out[r.id] = _stats_of(bundle, r.id)
    return out


def _stats_of(bundle: Bundle, record_id: str) -> dict[str, Any]:
    values = bundle.record_values(record_id)
    if values is None or values.size == 0 or values.dtype.kind not in "fiub":
        return {"numel": 0 if values is None else int(values.size)}
    v = np.asarray(values, dtype=np.float64).ravel()
    finite = v[np.isfinite(v)]
    stats: dict[str, Any] = {"numel": int(v.size), "nan": int(np.isnan(v).sum()), "inf": int(np.isinf(v).sum()),
                             "zeros": int((v == 0).sum())}
    if finite.size:
        stats.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()),
                     std=float(finite.std()), l2=float(np.linalg.norm(finite)), absmax=float(np.abs(finite).max()))
    return stats


def op_detail(db: Database, store: BlobStore, c: Comparison, key: str) -> OpDetail:
    """One op of one comparison with its full metrics, error histogram and both sides' statistics."""
    with db.session() as s:
        row = s.scalar(select(OpResultRow).where(OpResultRow.comparison_id == c.id, OpResultRow.key == key).limit(1))
    if row is None:
        raise NotFound(f"op {key!r} is not in comparison {c.id}")
    metrics = row.metrics or {}
    stats: list[dict[str, Any] | None] = []
    for side in (c.reference, c.target):
        try:
            stats.append(_record_stats(store, side.storage_key).get(key))
        except (OpbandError, OSError, KeyError):  # a blob gone or unreadable: the page shows the rest
            stats.append(None)
    return OpDetail(comparison=comparison_public(c), result=OpResultPublic.model_validate(row),
                    histogram=histogram_bins(list(metrics.get("histogram") or [])),
                    quantiles=dict(metrics.get("quantiles") or {}), reference_stats=stats[0], target_stats=stats[1])


def heatmap(db: Database, project: Project, metric: str, target: str | None, runs: int, ops: int,
            order: str = "execution") -> Heatmap:
    """Ops x the last ``runs`` finished comparisons: the ``ops`` ops that were worst in that window,
    coloured by ``metric`` (severity: value / limit of the worst metric). Rows in execution order (where
    drift starts reads top-down), or with ``order="similar"`` ops that move together next to each other."""
    if order not in HEATMAP_ORDERS:
        raise InvalidInput(f"order must be one of {list(HEATMAP_ORDERS)}, not {order!r}")
    if metric not in METRIC_COLUMNS:
        raise InvalidInput(f"metric must be one of {sorted(METRIC_COLUMNS)}, not {metric!r}")
    col = METRIC_COLUMNS[metric]
    with db.session() as s:
        q = select(Comparison).where(Comparison.project_id == project.id, Comparison.status == "done")
        if target:
            q = q.where(Comparison.target_id.in_(select(BundleRow.id).where(BundleRow.project_id == project.id,
                                                                           BundleRow.target == target)))
        comps = list(s.scalars(q.order_by(Comparison.created_at.desc()).limit(runs)))
        comps.reverse()
        ids = [c.id for c in comps]
        worst = s.execute(
            select(OpResultRow.key, func.min(OpResultRow.op), func.min(OpResultRow.index))
            .where(OpResultRow.comparison_id.in_(ids))
            .group_by(OpResultRow.key)
            .order_by(func.max(OpResultRow.severity).desc().nulls_last(), func.min(OpResultRow.index))
            .limit(ops)).all() if ids else []
        keys = [k for k, _, _ in worst]
        cells = s.execute(select(OpResultRow.key, OpResultRow.comparison_id, col, OpResultRow.verdict)
                          .where(OpResultRow.comparison_id.in_(ids), OpResultRow.key.in_(keys))).all() if keys else []
    rows = sorted(worst, key=lambda w: w[2])  # execution order: where drift starts reads top-down
    at = {cid: j for j, cid in enumerate(ids)}
    pos = {k: i for i, (k, _, _) in enumerate(rows)}
    z: list[list[float | None]] = [[None] * len(ids) for _ in rows]
    verdicts: list[list[str | None]] = [[None] * len(ids) for _ in rows]
    for k, cid, value, verdict in cells:
        v = None if value is None else float(value)
        if v is not None and abs(v) >= SEVERITY_INF:
            v = SEVERITY_CAP if metric == "severity" else None
        z[pos[k]][at[cid]] = min(v, SEVERITY_CAP) if v is not None and metric == "severity" else v
        verdicts[pos[k]][at[cid]] = verdict
    if order == "similar" and len(rows) > 2:
        perm = similar_rows(z, log=metric not in ("cosine", "snr_db"))
        rows, z, verdicts = [rows[i] for i in perm], [z[i] for i in perm], [verdicts[i] for i in perm]
    return Heatmap(metric=metric, runs=[HeatmapRun(comparison_id=c.id, created_at=c.created_at, target=c.target.target,
                                                   label=c.target.label, verdict=c.verdict) for c in comps],
                   ops=[HeatmapOp(key=k, op=o, index=i) for k, o, i in rows], z=z, verdicts=verdicts)


def similar_rows(z: list[list[float | None]], log: bool = True) -> list[int]:
    """A row order that puts ops whose values move together across runs next to each other: average-linkage
    clustering of the rows (log10 of the values for error metrics; a run an op was not in counts as its mean)."""
    from scipy.cluster.hierarchy import leaves_list, linkage

    m = np.array([[np.nan if v is None else v for v in row] for row in z], dtype=np.float64)
    if log:
        m = np.log10(np.clip(m, 1e-12, None))
    means = np.nanmean(np.where(np.isnan(m).all(axis=1, keepdims=True), 0.0, m), axis=1, keepdims=True)
    m = np.where(np.isnan(m), means, m)
    return [int(i) for i in leaves_list(linkage(m, method="average", metric="euclidean", optimal_ordering=True))]


def regression_events(db: Database, project: Project, regression_id: int | None, limit: int,
                      offset: int) -> tuple[list[RegressionEventPublic], int]:
    """The audit of decisions about this project's regressions, newest first."""
    q = (select(RegressionEvent, Regression.key, Series.target)
         .join(Regression, Regression.id == RegressionEvent.regression_id)
         .join(Series, Series.id == Regression.series_id)
         .where(RegressionEvent.project_id == project.id))
    if regression_id is not None:
        q = q.where(RegressionEvent.regression_id == regression_id)
    with db.session() as s:
        count = s.scalar(select(func.count()).select_from(q.subquery())) or 0
        rows = s.execute(q.order_by(RegressionEvent.at.desc(), RegressionEvent.id.desc())
                         .limit(limit).offset(offset)).all()
    out = [RegressionEventPublic(id=e.id, regression_id=e.regression_id, key=k, target=t, status=e.status,
                                 actor=e.actor, note=e.note, deviation_id=e.deviation_id, expires_at=e.expires_at,
                                 at=e.at) for e, k, t in rows]
    return out, count
