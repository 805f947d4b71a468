"""Comparison jobs: claim with a lease, run accuracy.compare, persist per-op results and regressions.

A job is a ``comparisons`` row. Workers claim pending rows (PostgreSQL: ``FOR UPDATE SKIP
LOCKED``) and hold a lease they renew while working; a worker that dies stops renewing, its lease
expires and the next worker retries the job, up to ``max_job_attempts``. Errors in the data
(a bundle that cannot be compared) fail the job at once with the error text.
"""

from __future__ import annotations

import fcntl
import fnmatch
import logging
import multiprocessing
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, delete, func, insert, or_, select, update
from sqlalchemy.orm import lazyload

import accuracy
from accuracy.verdicts import Verdict
from accuracy.compare import ComparisonPlan, conclude, judge_range, plan_comparison
from accuracy.errors import OpbandError
from accuracy.report import op_to_dict
from api.store.curation import regression_event
from api.store.db import Database
from api.jobs import shards
from api.store.models import (
    AcceptedDeviation, Baseline, BaselineMember, Comparison, ComparisonShard, OpResultRow, Project, Regression, Series,
    aware, utcnow,
)
from api.observability import JOB_SECONDS, JOBS_FINISHED
from api.schemas import SEVERITY_INF
from api.settings import Settings
from api.store.blobs import BlobStore

log = logging.getLogger("opband.jobs")
_CLAIM_LOCK = threading.Lock()  # SQLite has no SKIP LOCKED: serialise claims within the process
_PERSIST_LOCK = threading.Lock()  # SQLite: one writer of results at a time within the process


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident()}"


def claim_next(db: Database, settings: Settings, name: str) -> str | None:
    """Claim the oldest runnable job (pending, or running with an expired lease); return its id.

    Shards of split comparisons (:mod:`api.jobs.shards`, ids ``<comparison>:<index>``) come first: they
    finish work already started. PostgreSQL locks the candidate with ``FOR UPDATE SKIP LOCKED`` so
    concurrent workers pick different rows; the claim itself is a conditional UPDATE (same status and
    attempt count as read), so two processes on SQLite cannot both win one row either.
    """
    with _CLAIM_LOCK:
        return _claim(db, settings, name, ComparisonShard) or _claim(db, settings, name, Comparison)


def claim_shard_of(db: Database, settings: Settings, name: str, comparison_id: str) -> str | None:
    """Claim the next runnable shard of one comparison (a worker that judged one goes on with its plan open)."""
    with _CLAIM_LOCK:
        return _claim(db, settings, name, ComparisonShard, ComparisonShard.comparison_id == comparison_id)


def _claim(db: Database, settings: Settings, name: str, model: type[Comparison] | type[ComparisonShard],
           *where: Any) -> str | None:
    with db.session() as s:
        now = utcnow()
        q = (
            select(model)
            .where(or_(model.status == "pending", and_(model.status == "running", model.lease_until < now)), *where)
            .order_by(model.created_at, *([ComparisonShard.index] if model is ComparisonShard else []))
            .limit(1)
            .options(lazyload("*"))  # no outer joins: PostgreSQL refuses FOR UPDATE on them
        )
        if db.engine.dialect.name == "postgresql":
            q = q.with_for_update(skip_locked=True)
        job = s.scalar(q)
        if job is None:
            return None
        job_id, attempts = job.id, job.attempts
        was_running, previous_worker = job.status == "running", job.worker  # read before the UPDATE syncs `job`
        same = (model.id == job.id, model.status == job.status, model.attempts == job.attempts)
        if job.attempts >= settings.max_job_attempts and model is ComparisonShard:
            s.rollback()  # the comparison row is locked before its shards (one lock order): a transaction of its own
        elif job.attempts >= settings.max_job_attempts:
            s.execute(update(model).where(*same).values(
                status="failed", finished_at=now, lease_until=None,
                error=(f"gave up after {job.attempts} attempts: the worker running it stopped "
                       "(crashed, killed or out of memory) each time; see the worker logs")))
            log.warning("job given up", extra={"job_id": job.id, "attempts": job.attempts})
            return None
        else:
            claimed = s.execute(update(model).where(*same).values(
                status="running", worker=name, started_at=now, attempts=job.attempts + 1,
                lease_until=now + timedelta(seconds=settings.job_lease_seconds)))
            if claimed.rowcount != 1:  # type: ignore[attr-defined]
                return None
            if was_running:
                log.warning("retrying a job whose lease expired",
                            extra={"job_id": job.id, "previous_worker": previous_worker, "worker": name})
            return job_id
    with _persist_lock(db), db.session() as s:
        shards.give_up_shard(s, db, job_id, attempts)
    return None


def renew_lease(db: Database, settings: Settings, job_id: str, name: str) -> bool:
    """Extend this worker's lease on a job (or shard); False when it is no longer ours."""
    with db.session() as s:
        job = s.get(ComparisonShard if shards.is_shard(job_id) else Comparison, job_id)
        if job is None or job.status != "running" or job.worker != name:
            return False
        job.lease_until = utcnow() + timedelta(seconds=settings.job_lease_seconds)
        return True


class Heartbeat:
    """Renews a job's lease every third of the lease time while the job runs, from its own thread."""

    def __init__(self, db: Database, settings: Settings, job_id: str, name: str) -> None:
        self.db, self.settings, self.job_id, self.name = db, settings, job_id, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"lease-{job_id[:8]}", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.settings.job_lease_seconds / 3):
            try:
                if not renew_lease(self.db, self.settings, self.job_id, self.name):
                    return
            except Exception:  # noqa: BLE001 - retried at the next beat; the lease has slack
                log.warning("renewing the lease failed", extra={"job_id": self.job_id}, exc_info=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def run_job(db: Database, store: BlobStore, settings: Settings, job_id: str, name: str) -> str:
    """Run one claimed comparison to done or failed; returns the final status. Never raises.

    If even recording the outcome fails (the database went away), the job keeps its lease, which
    expires, and the next claim retries it; the worker itself carries on.
    """
    started = time.monotonic()
    try:
        status = (_run_in_child if settings.job_in_child_process else _run_job)(db, store, settings, job_id, name)
    except Exception:  # noqa: BLE001 - a worker must outlive any one job
        log.exception("job could not be run or recorded; it is retried when its lease expires",
                      extra={"job_id": job_id, "worker": name})
        status = "interrupted"
    seconds = time.monotonic() - started
    JOB_SECONDS.labels(status).observe(seconds)
    JOBS_FINISHED.labels(status).inc()
    log.info("job finished", extra={"job_id": job_id, "worker": name, "status": status,
                                    "duration_ms": round(seconds * 1000, 1)})
    return status


def _run_in_child(db: Database, store: BlobStore, settings: Settings, job_id: str, name: str) -> str:
    """:func:`_run_job` in a short-lived child process (forkserver, one job each): the memory a comparison
    takes is returned when it ends, and a child killed (out of memory, by a signal) does not take the
    API down; its lease then runs out and the job is retried, up to ``max_job_attempts``."""
    with ProcessPoolExecutor(1, mp_context=_job_context(), max_tasks_per_child=1) as pool:
        try:
            return pool.submit(_child_job, settings, job_id, name, os.getpid()).result()
        except BrokenProcessPool:
            raise RuntimeError("the comparison's process died (out of memory or killed)") from None


#: what the forkserver imports once, before it forks a job's process
JOB_PRELOAD = ["api.jobs.comparisons", "api.jobs.kernels"]


def _job_context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(JOB_PRELOAD)
    return context


def start_job_processes(settings: Settings, wait: bool = False) -> None:
    """Start the forkserver of the job processes (imports, metric kernels) now, while the worker is idle,
    rather than in its first job. ``wait``: until it has forked a first process (else in the background)."""
    if not settings.job_in_child_process:
        return
    if wait:
        with ProcessPoolExecutor(1, mp_context=_job_context(), max_tasks_per_child=1) as pool:
            pool.submit(os.getpid).result()
        return
    from multiprocessing import forkserver

    _job_context()
    forkserver.ensure_running()


def _exit_with_worker(worker_pid: int) -> None:
    """End this job process when its worker dies: an orphan would keep renewing the job's lease and finish
    it unseen, where the job should be retried by another worker once the lease runs out. (Its parent is
    the forkserver, which lives on while any process forked from it does.)"""
    def watch() -> None:
        while _alive(worker_pid):
            time.sleep(0.2)
        os._exit(3)

    threading.Thread(target=watch, name="worker-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc: the kill above said it exists


def _child_job(settings: Settings, job_id: str, name: str, worker_pid: int) -> str:
    from api.observability import configure_logging
    from api.store.blobs import make_store

    _exit_with_worker(worker_pid)
    configure_logging(settings)
    db = Database(settings)
    try:
        return _run_job(db, make_store(settings.effective_store_url, settings.s3_endpoint_url), settings, job_id, name)
    finally:
        db.dispose()


@contextmanager
def _persist_lock(db: Database) -> Iterator[None]:
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


@dataclass
class _Job:
    """What a worker reads of a comparison (or of a shard's comparison) before it opens any bundle."""

    id: str
    ref_key: str
    tgt_key: str
    mode: str
    attempt: int
    target: str  # the target name: series, bands and regressions are kept per target
    members: list[str]
    history: dict[str, Any] | None
    requested_shards: int | None = None
    shard_plan: dict[str, Any] | None = None  # set once split
    merge: bool = False  # every shard is judged: conclude
    start: int = 0
    stop: int = 0  # a shard's range of pairs


def _read_job(db: Database, job_id: str) -> _Job:
    with db.session() as s:
        shard = s.get(ComparisonShard, job_id) if shards.is_shard(job_id) else None
        job = s.get(Comparison, shard.comparison_id if shard else job_id)
        assert job is not None
        plan = job.shard_plan
        target = job.target.target
        if plan is not None:
            members = plan["history"]
            missing = len(members) - s.scalar(select(func.count()).select_from(Comparison)
                                              .where(Comparison.id.in_(members)))
            if missing:
                raise OpbandError(f"{missing} of the {len(members)} baseline comparisons this sharded comparison is "
                                  "judged against were deleted while it ran: queue it again")
        else:
            members = accepted_members(s, job.project_id, job.id)
        history = accepted_history(s, job.project_id, target, job.id, members)
        return _Job(job_id, job.reference.storage_key, job.target.storage_key, job.mode,
                    shard.attempts if shard else job.attempts, target, members, history, job.shards, plan,
                    merge=plan is not None and shard is None, start=shard.start if shard else 0,
                    stop=shard.stop if shard else 0)


def _run_job(db: Database, store: BlobStore, settings: Settings, job_id: str, name: str) -> str:
    fail = _fail_shard if shards.is_shard(job_id) else _fail
    try:
        job = _read_job(db, job_id)
    except OpbandError as e:
        return fail(db, job_id, f"{type(e).__name__}: {e}", name)
    phase = "shard" if shards.is_shard(job_id) else "merge" if job.merge else "comparison"
    log.info("job started", extra={"job_id": job_id, "worker": name, "attempt": job.attempt, "mode": job.mode,
                                   "phase": phase})
    try:
        with Heartbeat(db, settings, job_id, name), store.local_path(job.ref_key) as ref_path, \
                store.local_path(job.tgt_key) as tgt_path:
            plan = plan_comparison(ref_path, tgt_path, mode=job.mode, history=job.history, target_id=job.target)
            if job.shard_plan is not None:
                shards.check_plan(plan, job.shard_plan)
            if phase == "shard":
                status = _finish_shard(db, settings, job_id,
                                       shards.encode_results(judge_range(plan, job.start, job.stop)), name)
                return _judge_more_shards(db, settings, plan, shards.comparison_of(job_id), name, status)[0]
            if phase == "merge":
                return _merge(db, plan, job.id, name)
            weights = shards.pair_bytes(plan)
            n = shards.shard_count(settings, job.requested_shards, sum(weights), len(plan.pairs))
            if n > 1:
                status = _split(db, job, plan, weights, n, name)
                if status != "sharded":
                    return status
                status, merged = _judge_more_shards(db, settings, plan, job_id, name)  # the splitter judges too
                return status if merged else "sharded"
            return persist_report(db, job_id, conclude(plan, judge_range(plan, 0, len(plan.pairs))), name)
    except OpbandError as e:
        return fail(db, job_id, f"{type(e).__name__}: {e}", name)
    except Exception as e:  # noqa: BLE001 - recorded on the job; the worker carries on
        log.exception("comparison failed", extra={"job_id": job_id})
        return fail(db, job_id, f"internal error ({type(e).__name__}: {e}); please report it with this comparison id",
                    name)


def _judge_more_shards(db: Database, settings: Settings, plan: ComparisonPlan, comparison_id: str, name: str,
                       status: str = "done") -> tuple[str, bool]:
    """Claim and judge further shards of the same comparison in this process, with the plan already open (no
    new process, no re-planning per shard), each under its own lease, until none is left to claim; then, if
    this worker finished the last shard, merge here too. ``status``: how the shard judged just before ended
    (go on only after ``"done"``). Returns the last status and whether this worker merged."""
    while status == "done" and (job_id := claim_shard_of(db, settings, name, comparison_id)) is not None:
        with db.session() as s:
            row = s.get(ComparisonShard, job_id)
            assert row is not None
            start, stop, attempt = row.start, row.stop, row.attempts
        log.info("job started", extra={"job_id": job_id, "worker": name, "attempt": attempt, "phase": "shard",
                                       "chained": True})
        try:
            with Heartbeat(db, settings, job_id, name):
                status = _finish_shard(db, settings, job_id, shards.encode_results(judge_range(plan, start, stop)),
                                       name)
        except OpbandError as e:
            status = _fail_shard(db, job_id, f"{type(e).__name__}: {e}", name)
        except Exception as e:  # noqa: BLE001 - recorded on the shard's comparison; the worker carries on
            log.exception("comparison shard failed", extra={"job_id": job_id})
            status = _fail_shard(db, job_id, f"internal error ({type(e).__name__}: {e}); please report it with this "
                                 "comparison id", name)
        log.info("shard finished", extra={"job_id": job_id, "worker": name, "status": status})
    if status != "merge":
        return status, False
    log.info("job started", extra={"job_id": comparison_id, "worker": name, "attempt": 1, "phase": "merge",
                                   "chained": True})
    try:
        with Heartbeat(db, settings, comparison_id, name):
            return _merge(db, plan, comparison_id, name), True
    except OpbandError as e:
        return _fail(db, comparison_id, f"{type(e).__name__}: {e}", name), True
    except Exception as e:  # noqa: BLE001 - recorded on the comparison; the worker carries on
        log.exception("comparison merge failed", extra={"job_id": comparison_id})
        return _fail(db, comparison_id, f"internal error ({type(e).__name__}: {e}); please report it with this "
                     "comparison id", name), True


def _merge(db: Database, plan: ComparisonPlan, comparison_id: str, name: str) -> str:
    """Conclude a sharded comparison from its shards' results and persist it as an unsharded run would."""
    return persist_report(db, comparison_id, conclude(plan, shards.load_results(db, comparison_id, plan)), name)


def _split(db: Database, job: _Job, plan: ComparisonPlan, weights: list[int], n: int, name: str) -> str:
    """Queue the comparison's shards (:mod:`api.jobs.shards`) and park it until they are judged."""
    ranges = shards.split_ranges(weights, n)
    shard_plan = {"schema": shards.SHARD_PLAN_SCHEMA, "pairs": len(plan.pairs), "digest": shards.plan_digest(plan),
                  "bytes": sum(weights), "history": job.members}
    with db.session() as s:
        row = _owned(s, db, job.id, name)
        if row is None:
            return "lost"
        shards.park_for_shards(s, row, ranges, weights, shard_plan)
    return "sharded"


def _finish_shard(db: Database, settings: Settings, job_id: str, blob: bytes, name: str) -> str:
    with _persist_lock(db), db.session() as s:
        return shards.finish_shard(s, db, job_id, blob, name, timedelta(seconds=settings.job_lease_seconds))


def _fail_shard(db: Database, job_id: str, error: str, name: str) -> str:
    with _persist_lock(db), db.session() as s:
        return shards.fail_shard(s, db, job_id, error, name)


def _owned(s: Any, db: Database, job_id: str, name: str) -> Comparison | None:
    """The job row, locked, if this worker still holds it (a worker whose lease ran out must not write)."""
    job = shards.lock_comparison(s, db, job_id)
    lost = "lost the lease: another worker took the job over, dropping this result"
    return job if shards.held_by(job, job_id, name, lost) else None


def _fail(db: Database, job_id: str, error: str, name: str) -> str:
    with db.session() as s:
        job = _owned(s, db, job_id, name)
        if job is None:
            return "lost"
        job.status, job.error, job.finished_at, job.lease_until = "failed", error[:4000], utcnow(), None
    return "failed"


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _severity(x: float) -> float | None:
    """A severity for the database: +inf (a NaN/Inf outcome, a shape mismatch) becomes
    ``SEVERITY_INF``, so "worst first" puts those failures first; NaN is unknown (NULL)."""
    if math.isnan(x):
        return None
    return SEVERITY_INF if x >= SEVERITY_INF else max(x, -SEVERITY_INF)


def persist_report(db: Database, job_id: str, report: accuracy.ComparisonReport, name: str) -> str:
    """Write the per-op results, drift series and regressions of a finished comparison.

    Writes of one project are serialised (PostgreSQL: a row lock on the project; SQLite: a lock file
    next to the database) so that two workers never both create the same drift series or regression.
    """
    with _persist_lock(db), db.session() as s:
        job = _owned(s, db, job_id, name)
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


class WorkerPool:
    """In-process comparison workers (the embedded default): threads that claim and run jobs."""

    def __init__(self, db: Database, store: BlobStore, settings: Settings, poll_seconds: float | None = None) -> None:
        self.db, self.store, self.settings = db, store, settings
        self.poll_seconds = settings.poll_seconds if poll_seconds is None else poll_seconds
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        if self.settings.workers:
            start_job_processes(self.settings)
        for i in range(self.settings.workers):
            t = threading.Thread(target=self._loop, name=f"opband-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def alive(self) -> int:
        """How many worker threads are running."""
        return sum(t.is_alive() for t in self._threads)

    def notify(self) -> None:
        """A job was queued: wake an idle worker now rather than at its next poll."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def _loop(self) -> None:
        name = worker_name()
        while not self._stop.is_set():
            try:
                job_id = claim_next(self.db, self.settings, name)
            except Exception:  # noqa: BLE001 - database hiccup: log, back off, retry
                log.exception("claiming a job failed")
                job_id = None
            if job_id is None:
                self._wake.wait(self.poll_seconds)
                self._wake.clear()
                continue
            run_job(self.db, self.store, self.settings, job_id, name)


def run_worker_forever(db: Database, store: BlobStore, settings: Settings,
                       should_stop: Callable[[], bool] = lambda: False, poll_seconds: float | None = None) -> None:
    """``opband worker``: one process claiming jobs from the shared database until stopped (an idle worker
    looks every ``poll_seconds``, default ``settings.poll_seconds``; after a database error it backs off)."""
    poll_seconds = settings.poll_seconds if poll_seconds is None else poll_seconds
    name = worker_name()
    start_job_processes(settings, wait=True)
    log.info("worker started", extra={"worker": name})
    while not should_stop():
        try:
            job_id = claim_next(db, settings, name)
        except Exception:  # noqa: BLE001 - database restarting: back off and retry
            log.exception("claiming a job failed", extra={"worker": name})
            time.sleep(max(poll_seconds, 1.0))
            continue
        if job_id is None:
            time.sleep(poll_seconds)
            continue
        run_job(db, store, settings, job_id, name)
