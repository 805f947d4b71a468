"""Comparison jobs: claim with a lease, run accuracy.compare, persist per-op results and regressions.

A job is a ``comparisons`` row. Workers claim pending rows (PostgreSQL: ``FOR UPDATE SKIP
LOCKED``) and hold a lease they renew while working; a worker that dies stops renewing, its lease
expires and the next worker retries the job, up to ``max_job_attempts``. Errors in the data
(a bundle that cannot be compared) fail the job at once with the error text.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import lazyload

from accuracy.compare import ComparisonPlan, conclude, judge_range, plan_comparison
from accuracy.errors import OpbandError
from api.jobs.results import (
    accepted_history, accepted_members, owned_job, persist_lock, persist_report,
)
from api.store.db import Database
from api.jobs import shards
from api.store.models import (
    Comparison, ComparisonShard, utcnow,
)
from api.observability import JOB_SECONDS, JOBS_FINISHED
from api.settings import Settings
from api.store.blobs import BlobStore

log = logging.getLogger("opband.jobs")
_CLAIM_LOCK = threading.Lock()  # SQLite has no SKIP LOCKED: serialise claims within the process


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
    with persist_lock(db), db.session() as s:
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
JOB_PRELOAD = ["api.jobs.comparisons", "api.jobs.results", "api.jobs.kernels"]


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
    from api.store.blobs import store_from_settings

    _exit_with_worker(worker_pid)
    configure_logging(settings)
    db = Database(settings)
    try:
        return _run_job(db, store_from_settings(settings), settings, job_id, name)
    finally:
        db.dispose()


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
        row = owned_job(s, db, job.id, name)
        if row is None:
            return "lost"
        shards.park_for_shards(s, row, ranges, weights, shard_plan)
    return "sharded"


def _finish_shard(db: Database, settings: Settings, job_id: str, blob: bytes, name: str) -> str:
    with persist_lock(db), db.session() as s:
        return shards.finish_shard(s, db, job_id, blob, name, timedelta(seconds=settings.job_lease_seconds))


def _fail_shard(db: Database, job_id: str, error: str, name: str) -> str:
    with persist_lock(db), db.session() as s:
        return shards.fail_shard(s, db, job_id, error, name)


def _fail(db: Database, job_id: str, error: str, name: str) -> str:
    with db.session() as s:
        job = owned_job(s, db, job_id, name)
        if job is None:
            return "lost"
        job.status, job.error, job.finished_at, job.lease_until = "failed", error[:4000], utcnow(), None
    return "failed"


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
        def idle(seconds: float) -> None:
            self._wake.wait(seconds)
            self._wake.clear()

        work(self.db, self.store, self.settings, worker_name(), self._stop.is_set, idle, self.poll_seconds)


def work(db: Database, store: BlobStore, settings: Settings, name: str, should_stop: Callable[[], bool],
         idle: Callable[[float], None], poll_seconds: float) -> None:
    """One worker's loop, in a thread or a process: claim a job and run it until ``should_stop``; idle
    ``poll_seconds`` when the queue is empty, at least a second after a database error."""
    while not should_stop():
        try:
            job_id = claim_next(db, settings, name)
        except Exception:  # noqa: BLE001 - database hiccup or restart: log, back off, retry
            log.exception("claiming a job failed", extra={"worker": name})
            idle(max(poll_seconds, 1.0))
            continue
        if job_id is None:
            idle(poll_seconds)
            continue
        run_job(db, store, settings, job_id, name)


def run_worker_forever(db: Database, store: BlobStore, settings: Settings,
                       should_stop: Callable[[], bool] = lambda: False, poll_seconds: float | None = None) -> None:
    """``opband worker``: one process claiming jobs from the shared database until stopped (an idle worker
    looks every ``poll_seconds``, default ``settings.poll_seconds``; after a database error it backs off)."""
    poll_seconds = settings.poll_seconds if poll_seconds is None else poll_seconds
    name = worker_name()
    start_job_processes(settings, wait=True)
    log.info("worker started", extra={"worker": name})
    work(db, store, settings, name, should_stop, time.sleep, poll_seconds)
