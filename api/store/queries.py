"""Read queries behind the routes: filtered, sorted, paginated; indexes, not scans."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, case, func, or_, select

from accuracy import envdiff
from accuracy.verdicts import TABLE_ORDER, Verdict
from api.store.db import Database
from api.errors import InvalidInput, NotFound
from api.store.models import BundleRow, Comparison, OpResultRow, Project, Regression, Series
from api.schemas import SEVERITY_INF, BundleDiff, DriftPoint, DriftSeries, EnvironmentChange, TargetPublic

METRIC_COLUMNS = {
    "norm_l2": OpResultRow.norm_l2, "max_abs": OpResultRow.max_abs, "max_rel": OpResultRow.max_rel,
    "cosine": OpResultRow.cosine, "snr_db": OpResultRow.snr_db, "severity": OpResultRow.severity,
}
#: which budget entry bounds each metric (the band drawn under a drift line)
BAND_OF_METRIC = {"norm_l2": "norm_l2", "cosine": "cosine_min"}
SORTS = METRIC_COLUMNS | {"index": OpResultRow.index, "key": OpResultRow.key, "worst": OpResultRow.severity}
VERDICTS = tuple(v.value for v in Verdict)  # every verdict name, for filters
REGRESSION_STATUSES = ("active", "acknowledged", "accepted", "resolved")
COMPARISON_STATUSES = ("pending", "running", "done", "failed")
#: ``sort=worst``: the order of the offline table (accuracy ComparisonReport.worst_first): verdict
#: (fail, warn, missing, pass, new: TABLE_ORDER), local before inherited, then severity
_VERDICT_RANK = case({v: i for i, v in enumerate(TABLE_ORDER)}, value=OpResultRow.verdict, else_=-1)


def _statuses(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """``a,b`` -> ["a", "b"], each one of ``allowed``; a 422 naming the unknown ones otherwise."""
    wanted = [v for v in value.split(",") if v]
    bad = [v for v in wanted if v not in allowed]
    if bad or not wanted:
        raise InvalidInput(f"unknown {what} status(es) {bad or [value]}; use any of {list(allowed)}, comma-separated")
    return wanted

T = TypeVar("T")


def glob_to_like(pattern: str) -> str:
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%").replace("?", "_")


def _page(db: Database, q: Select[Any], limit: int, offset: int) -> tuple[list[Any], int]:
    with db.session() as s:
        count = s.scalar(select(func.count()).select_from(q.order_by(None).subquery())) or 0
        rows = list(s.scalars(q.limit(limit).offset(offset)))
    return rows, count


def list_projects(db: Database) -> list[Project]:
    with db.session() as s:
        return list(s.scalars(select(Project).order_by(Project.name)))


def list_bundles(db: Database, project: Project, limit: int, offset: int, *, label: str | None = None,
                 target: str | None = None, tags: dict[str, str] | None = None) -> tuple[list[BundleRow], int]:
    q = select(BundleRow).where(BundleRow.project_id == project.id)
    if label:
        q = q.where(BundleRow.label == label)
    if target:
        q = q.where(BundleRow.target == target)
    for key, value in (tags or {}).items():
        q = q.where(BundleRow.tags[key].as_string() == value)
    return _page(db, q.order_by(BundleRow.created_at.desc()), limit, offset)


def targets(db: Database, project: Project) -> list[TargetPublic]:
    """Each target name of the project with its run count and its latest finished comparison."""
    with db.session() as s:
        rows = s.execute(select(BundleRow.target, func.count(), func.max(BundleRow.created_at))
                         .where(BundleRow.project_id == project.id).group_by(BundleRow.target)
                         .order_by(BundleRow.target)).all()
        out = []
        for name, count, last in rows:
            latest = s.execute(
                select(Comparison.id, Comparison.verdict, BundleRow.label)
                .join(BundleRow, BundleRow.id == Comparison.target_id)
                .where(Comparison.project_id == project.id, Comparison.status == "done", BundleRow.target == name)
                .order_by(Comparison.created_at.desc()).limit(1)).first()
            out.append(TargetPublic(target=name, bundles=count, last_upload=last,
                                    latest_comparison_id=latest[0] if latest else None,
                                    latest_verdict=latest[1] if latest else None,
                                    latest_label=latest[2] if latest else None))
    return out


def _get(db: Database, model: type[T], ident: str | int, what: str) -> T:
    """The row of ``model`` with primary key ``ident``, or NotFound naming it."""
    with db.session() as s:
        row = s.get(model, ident)
    if row is None:
        raise NotFound(f"{what} {ident!r} does not exist")
    return row


def get_bundle(db: Database, bundle_id: str) -> BundleRow:
    return _get(db, BundleRow, bundle_id, "bundle")


def get_comparison(db: Database, comparison_id: str) -> Comparison:
    return _get(db, Comparison, comparison_id, "comparison")


def list_comparisons(db: Database, project: Project, limit: int, offset: int, status: str | None = None, *,
                     target: str | None = None, label: str | None = None) -> tuple[list[Comparison], int]:
    """Comparisons newest first; ``target``: the target run's target name, ``label``: either run's label."""
    q = select(Comparison).where(Comparison.project_id == project.id)
    if status:
        q = q.where(Comparison.status.in_(_statuses(status, COMPARISON_STATUSES, "comparison")))
    if target:
        q = q.where(Comparison.target_id.in_(select(BundleRow.id).where(BundleRow.project_id == project.id,
                                                                       BundleRow.target == target)))
    if label:
        q = q.where(or_(Comparison.target_id.in_(select(BundleRow.id).where(BundleRow.label == label)),
                        Comparison.reference_id.in_(select(BundleRow.id).where(BundleRow.label == label))))
    return _page(db, q.order_by(Comparison.created_at.desc()), limit, offset)


def op_results(
    db: Database, comparison_id: str, *, op: str | None = None, module: str | None = None,
    shape: str | None = None, verdict: str | None = None, metric: str | None = None,
    min_value: float | None = None, max_value: float | None = None, sort: str = "worst",
    order: str = "desc", limit: int = 50, offset: int = 0, with_metrics: bool = True,
    search: str | None = None, inherited: bool | None = None,
) -> tuple[list[OpResultRow], int]:
    """Per-op results of one comparison, filtered by op, module glob, input shapes, verdict, metric range,
    a substring of the op key (``search``) and whether the error was inherited."""
    get_comparison(db, comparison_id)
    q = select(OpResultRow).where(OpResultRow.comparison_id == comparison_id)
    if search:
        q = q.where(OpResultRow.key.like(f"%{glob_to_like(search)}%", escape="\\"))
    if inherited is not None:
        q = q.where(OpResultRow.inherited == inherited)
    if op:
        q = q.where(OpResultRow.op == op)
    if module:
        q = q.where(OpResultRow.module.like(glob_to_like(module), escape="\\"))
    if shape:
        q = q.where(OpResultRow.shape_signature == shape)
    if verdict:
        bad = [v for v in verdict.split(",") if v not in VERDICTS]
        if bad:
            raise InvalidInput(f"unknown verdict(s) {bad}; use any of {list(VERDICTS)}")
        q = q.where(OpResultRow.verdict.in_(verdict.split(",")))
    if min_value is not None or max_value is not None:
        if metric not in METRIC_COLUMNS:
            raise InvalidInput(f"metric range needs metric= one of {sorted(METRIC_COLUMNS)}")
        col = METRIC_COLUMNS[metric]
        if min_value is not None:
            q = q.where(col >= max(min(min_value, SEVERITY_INF), -SEVERITY_INF))  # inf: the stored sentinel
        if max_value is not None:
            q = q.where(col <= max(min(max_value, SEVERITY_INF), -SEVERITY_INF))
    if sort not in SORTS:
        raise InvalidInput(f"sort must be one of {sorted(SORTS)}, not {sort!r}")
    if order not in ("asc", "desc"):
        raise InvalidInput("order must be 'asc' or 'desc'")
    col = SORTS[sort]
    if sort == "worst":  # desc: worst first, as the offline table; asc: the reverse
        keys = [_VERDICT_RANK.desc(), OpResultRow.inherited.asc(), col.desc().nulls_last(), OpResultRow.index.asc()]
        if order == "asc":
            keys = [_VERDICT_RANK.asc(), OpResultRow.inherited.desc(), col.asc().nulls_first(), OpResultRow.index.desc()]
        q = q.order_by(*keys)
    else:
        q = q.order_by(col.desc().nulls_last() if order == "desc" else col.asc().nulls_last(), OpResultRow.index)
    return _page(db, q, limit, offset)


def regressions(db: Database, project: Project, status: str | None, op: str | None, shape: str | None,
                limit: int, offset: int, target: str | None = None, dtype: str | None = None,
                ) -> tuple[list[Regression], int]:
    q = select(Regression).where(Regression.project_id == project.id)
    if status:
        q = q.where(Regression.status.in_(_statuses(status, REGRESSION_STATUSES, "regression")))
    if target or dtype:
        q = q.join(Series, Series.id == Regression.series_id)
        if target:
            q = q.where(Series.target == target)
        if dtype:
            q = q.where(Series.dtype == dtype)
    if op:
        q = q.where(Regression.op == op)
    if shape:
        q = q.where(Regression.shape_signature == shape)
    return _page(db, q.order_by(Regression.updated_at.desc()), limit, offset)


def drift(db: Database, project: Project, metric: str, key: str | None, target: str | None,
          series_limit: int, points: int) -> list[DriftSeries]:
    """One line per (op key, shapes, dtype, target): the metric over the last ``points`` comparisons."""
    if metric not in METRIC_COLUMNS:
        raise InvalidInput(f"metric must be one of {sorted(METRIC_COLUMNS)}, not {metric!r}")
    col = METRIC_COLUMNS[metric]
    with db.session() as s:
        sq = select(Series).where(Series.project_id == project.id)
        if key:
            sq = sq.where(Series.key.like(glob_to_like(key), escape="\\"))
        if target:
            sq = sq.where(Series.target == target)
        if key:
            series = list(s.scalars(sq.limit(series_limit)))
        else:
            # every open regression and every recent first divergence, then the series that were ever
            # worst (an index, not a scan) up to ``series_limit``: what a person wants to see first
            must = _flagged_series_ids(s, project, target)
            series = list(s.scalars(sq.where(Series.id.in_(must)))) if must else []
            worst = sq.where(Series.id.not_in(must)) if must else sq
            series += list(s.scalars(worst.order_by(Series.worst_severity.desc().nulls_last())
                                     .limit(max(series_limit - len(series), 0))))
        out = []
        for ser in series:
            rows = s.execute(
                select(OpResultRow.comparison_id, OpResultRow.created_at, col, OpResultRow.verdict, OpResultRow.budget)
                .where(OpResultRow.series_id == ser.id)
                .order_by(OpResultRow.created_at.desc())
                .limit(points)
            ).all()
            pts = [DriftPoint(comparison_id=r[0], created_at=r[1], value=r[2], verdict=r[3],
                              budget=(r[4] or {}).get(BAND_OF_METRIC.get(metric, "")))
                   for r in reversed(rows)]
            out.append(DriftSeries(key=ser.key, shape_signature=ser.shape_signature, dtype=ser.dtype,
                                   target=ser.target, metric=metric, points=pts))
    return out


#: how many recent comparisons' first divergences the default drift view always shows
FIRST_DIVERGENCE_WINDOW = 50


def _flagged_series_ids(s: Any, project: Project, target: str | None) -> list[int]:
    """Series of the open regressions and of the recent comparisons' first divergences."""
    ids = set(s.scalars(select(Regression.series_id).where(Regression.project_id == project.id,
                                                          Regression.status.in_(("active", "acknowledged")))))
    recent = s.execute(select(Comparison.id, Comparison.first_divergence)
                       .where(Comparison.project_id == project.id, Comparison.status == "done")
                       .order_by(Comparison.created_at.desc()).limit(FIRST_DIVERGENCE_WINDOW)).all()
    for cid, fd in recent:
        if fd and fd.get("key"):
            key = fd["key"] if not fd.get("output") else f"{fd['key']}:{fd['output']}"
            ids.update(s.scalars(select(OpResultRow.series_id).where(OpResultRow.comparison_id == cid,
                                                                    OpResultRow.key == key).limit(1)))
    q = select(Series.id).where(Series.id.in_(ids - {None}))
    if target:
        q = q.where(Series.target == target)
    return list(s.scalars(q))


def get_regression(db: Database, regression_id: int) -> Regression:
    return _get(db, Regression, regression_id, "regression")


def bundle_diff(a: BundleRow, b: BundleRow) -> BundleDiff:
    """What differs between two bundles' capture setups: torch, driver/CUDA/CANN, dtype, flags, threads, device."""
    changed, same = envdiff.changes(envdiff.flatten(a.run, a.environment), envdiff.flatten(b.run, b.environment))
    return BundleDiff(a=a.id, b=b.id, changed=[EnvironmentChange(field=f, a=x, b=y) for f, x, y in changed], same=same)
