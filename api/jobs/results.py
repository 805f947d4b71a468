"""The results of a comparison job: the accepted history it is judged against, its persistence (op
results, series) and the regression lifecycle, each state change audited (``curation.regression_event``)."""

from __future__ import annotations

import fcntl
import fnmatch
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from sqlalchemy import delete, insert, select, update

import accuracy
from accuracy.verdicts import Verdict
from accuracy.report import op_to_dict
from api.jobs import shards
from api.store.curation import regression_event
from api.store.db import Database
from api.store.models import (
    AcceptedDeviation, Baseline, BaselineMember, Comparison, ComparisonShard, OpResultRow, Project, Regression, Series,
    aware, utcnow,
)
from api.schemas import SEVERITY_INF



_PERSIST_LOCK = threading.Lock()  # SQLite: one writer of results at a time within the process


@contextmanager
def persist_lock(db: Database) -> Iterator[None]:
    """SQLite: one writer of results at a time, across threads and the job processes of this host (an
    exclusive lock on a file next to the database); PostgreSQL locks the project row instead."""
    if db.engine.dialect.name != "sqlite" or not db.url.startswith("sqlite:///") or ":memory:" in db.url:
        with _PERSIST_LOCK if db.engine.dialect.name == "sqlite" else nullcontext():
            yield
        return
    with _PERSIST_LOCK, open(db.url.removeprefix("sqlite:///") + ".persist-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def accepted_members(s: Any, project_id: int, exclude: str) -> list[str]:
    """The comparisons of this project's baselines (other than ``exclude``), sorted: what bands learn from."""
    return sorted(s.scalars(
        select(BaselineMember.comparison_id).join(Baseline, Baseline.id == BaselineMember.baseline_id)
        .where(Baseline.project_id == project_id, BaselineMember.comparison_id != exclude).distinct()))


def accepted_history(s: Any, project_id: int, target: str, exclude: str,
                     members: list[str] | None = None) -> dict[str, Any] | None:
    """Per-op results of this project's baseline comparisons for ``target`` (``opband.history/1``).

    Bands are learned only from comparisons someone promoted into a baseline; with none, the
    comparison is judged against the default budgets alone. ``members``: those comparisons, as
    :func:`accepted_members` listed them earlier (a sharded comparison judges every shard by one list).
    """
    if members is None:
        members = accepted_members(s, project_id, exclude)
    rows = s.execute(
        select(OpResultRow.key, OpResultRow.output, OpResultRow.op, OpResultRow.shape_signature, OpResultRow.dtype,
               OpResultRow.metrics, OpResultRow.comparison_id)
        .join(Series, Series.id == OpResultRow.series_id)
        .where(OpResultRow.comparison_id.in_(members), OpResultRow.comparison_id != exclude,
               Series.target == target)
        .order_by(OpResultRow.id)  # one order every time: bands sum in it
    ).all() if members else []
    rows = [r for r in rows if isinstance(r.metrics, dict)]  # JSON null (unmatched ops) carries no metrics
    if not rows:
        return None
    results = [{"key": r.key.rsplit(":", 1)[0] if r.output else r.key, "output": r.output, "op": r.op,
                "shape_signature": r.shape_signature,
                "dtype": r.dtype, "target": target, "run": r.comparison_id, "metrics": r.metrics} for r in rows]
    return {"schema": "opband.history/1", "results": results}


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _severity(x: float) -> float | None:
    """A severity for the database: +inf (a NaN/Inf outcome, a shape mismatch) becomes
    ``SEVERITY_INF``, so "worst first" puts those failures first; NaN is unknown (NULL)."""
    if math.isnan(x):
        return None
    return SEVERITY_INF if x >= SEVERITY_INF else max(x, -SEVERITY_INF)


def owned_job(s: Any, db: Database, job_id: str, name: str) -> Comparison | None:
    """The job row, locked, if this worker still holds it (a worker whose lease ran out must not write)."""
    job = shards.lock_comparison(s, db, job_id)
    lost = "lost the lease: another worker took the job over, dropping this result"
    return job if shards.held_by(job, job_id, name, lost) else None


def persist_report(db: Database, job_id: str, report: accuracy.ComparisonReport, name: str) -> str:
    """Write the per-op results, drift series and regressions of a finished comparison.

    Writes of one project are serialised (PostgreSQL: a row lock on the project; SQLite: a lock file
    next to the database) so that two workers never both create the same drift series or regression.
    """
    with persist_lock(db), db.session() as s:
        job = owned_job(s, db, job_id, name)
        if job is None:
            return "lost"
        if db.engine.dialect.name == "postgresql":
            s.execute(select(Project.id).where(Project.id == job.project_id).with_for_update())
        target = job.target.target
        s.execute(delete(OpResultRow).where(OpResultRow.comparison_id == job_id))
        series = _series_for(s, job.project_id, target, report.ops)
        now = utcnow()
        for start in range(0, len(report.ops), RESULT_BATCH):  # Core inserts in batches: no ORM object per op
            s.execute(insert(OpResultRow), [_result_row(job_id, series[(o.id, o.shape_signature, o.dtype)].id, o, now)
                                            for o in report.ops[start:start + RESULT_BATCH]])
        _update_regressions(s, job, report, series)
        job.status, job.verdict, job.counts = "done", report.verdict, report.counts
        job.first_divergence = op_to_dict(report.first_divergence) if report.first_divergence else None
        if job.first_divergence and job.first_divergence.get("metrics"):
            job.first_divergence["metrics"].pop("histogram", None)
        job.generation = report.generation.as_dict() if report.generation is not None else None
        job.unmatched, job.finished_at, job.lease_until, job.error = len(report.unmatched), now, None, None
        if job.shards_done is not None:  # merged: the shards' results now live in op_results
            s.execute(update(ComparisonShard).where(ComparisonShard.comparison_id == job_id).values(results=None))
    return "done"


#: op_results rows per INSERT
RESULT_BATCH = 2000


def _result_row(job_id: str, series_id: int, o: accuracy.OpResult, now: Any) -> dict[str, Any]:
    m = o.metrics
    return dict(
        comparison_id=job_id, series_id=series_id, key=o.id, output=o.output, op=o.op, module=o.module, kind=o.kind,
        index=o.index, shape_signature=o.shape_signature[:1000], dtype=o.dtype, verdict=o.verdict, reason=o.reason,
        inherited=o.inherited, severity=_severity(o.severity),
        norm_l2=_finite(m.norm_l2) if m is not None else None,
        max_abs=_finite(m.max_abs) if m is not None else None,
        max_rel=_finite(m.max_rel) if m is not None else None,
        cosine=_finite(m.cosine) if m is not None else None,
        snr_db=_finite(m.snr_db) if m is not None else None,
        metrics=m.as_dict() if m is not None else None,
        budget=op_to_dict(o)["budget"], created_at=now,
    )


def _series_for(s: Any, project_id: int, target: str, ops: list[accuracy.OpResult]) -> dict[tuple[str, str, str], Series]:
    """The drift series of each op (created on first sight), keyed by (op id, shape signature, dtype)."""
    existing = {
        (x.key, x.shape_signature, x.dtype): x
        for x in s.scalars(select(Series).where(Series.project_id == project_id, Series.target == target))
    }
    out: dict[tuple[str, str, str], Series] = {}
    for o in ops:
        ident = (o.id, o.shape_signature[:1000], o.dtype)
        if ident not in existing:
            existing[ident] = Series(project_id=project_id, key=o.id, op=o.op, shape_signature=ident[1],
                                     dtype=o.dtype, target=target)
            s.add(existing[ident])
        out[(o.id, o.shape_signature, o.dtype)] = existing[ident]
        sev = _severity(o.severity)
        ser = existing[ident]
        if sev is not None and (ser.worst_severity is None or sev > ser.worst_severity):
            ser.worst_severity = sev
    s.flush()
    return out


def _update_regressions(s: Any, job: Comparison, report: accuracy.ComparisonReport,
                        series: dict[tuple[str, str, str], Series]) -> None:
    """Local failures open (or keep) a regression per series (op key, shapes, dtype, target name); a
    later pass of the same series closes it. A failure that a live
    accepted deviation matches is "accepted" (crediting that deviation); one whose deviation has
    expired or was deleted is open ("active") again. A status a person set is kept."""
    now = utcnow()
    deviations = [
        d for d in s.scalars(select(AcceptedDeviation).where(AcceptedDeviation.project_id == job.project_id))
        if d.expires_at is None or aware(d.expires_at) > now
    ]
    by_series = {r.series_id: r for r in s.scalars(select(Regression).where(Regression.project_id == job.project_id))}
    # a comparison older than the one a regression last saw (a late job) changes nothing of it:
    # only a later passing run of the same series resolves it
    seen = {r.last_comparison_id for r in by_series.values()}
    last_seen_at = dict(s.execute(select(Comparison.id, Comparison.created_at).where(Comparison.id.in_(seen))).all())
    job_at = aware(job.created_at)
    actor = f"opband (comparison {job.id})"
    changes: list[tuple[Regression, str, str, AcceptedDeviation | None]] = []  # audited after the flush gives ids
    for o in report.ops:
        ser = series[(o.id, o.shape_signature, o.dtype)]
        reg = by_series.get(ser.id)
        if reg is not None and reg.last_comparison_id in last_seen_at \
                and aware(last_seen_at[reg.last_comparison_id]) > job_at:
            continue
        # a module output that only carries its own ops' error is marked inherited by compare; one whose own ops
        # ran another implementation (or were not captured) is local: its boundary is where the error shows
        local = not o.inherited
        if o.verdict == Verdict.FAIL and local:
            match = next((d for d in deviations if fnmatch.fnmatchcase(o.id, d.key_pattern)
                          and d.shape_signature in (None, o.shape_signature)), None)
            if reg is None:
                reg = Regression(project_id=job.project_id, series_id=ser.id, key=o.id, op=o.op,
                                 shape_signature=o.shape_signature[:1000], first_comparison_id=job.id,
                                 last_comparison_id=job.id, reason=o.reason, created_at=now, updated_at=now,
                                 status="accepted" if match else "active", accepted_by=match.id if match else None)
                s.add(reg)
                by_series[ser.id] = reg
                changes.append((reg, reg.status, "opened: " + o.reason, match))
            else:
                before = reg.status
                reopened = reg.status == "resolved"
                if reopened:
                    reg.status, reg.first_comparison_id = "active", job.id
                # a deviation accepts a regression it opens again or already accepted; an "active" one
                # is left as is (a person may have set it so; new deviations accept open ones on creation)
                if match is not None and (reopened or reg.accepted_by is not None):
                    reg.status, reg.accepted_by = "accepted", match.id
                elif reg.status == "accepted" and reg.accepted_by is not None:  # its deviation expired: open again
                    reg.status, reg.accepted_by = "active", None
                    changes.append((reg, "active", "its accepted deviation expired or was withdrawn: " + o.reason, None))
                if reopened:
                    changes.append((reg, reg.status, "failed again: " + o.reason, match))
                elif reg.status == "accepted" and before != "accepted":
                    changes.append((reg, "accepted", o.reason, match))
                reg.last_comparison_id, reg.reason, reg.updated_at = job.id, o.reason, now
        elif o.verdict == Verdict.PASS and reg is not None and reg.status in ("active", "acknowledged"):
            reg.status, reg.last_comparison_id, reg.updated_at = "resolved", job.id, now
            changes.append((reg, "resolved", "the op passed again", None))
    if changes:
        s.flush()  # the new regressions' ids
        s.add_all(regression_event(reg, status, actor, note, d) for reg, status, note, d in changes)
