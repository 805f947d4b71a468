"""Sharded comparisons: one comparison of large bundles judged by several workers, concluded once.

A sharded comparison goes through three phases; the ``comparisons`` row is the job of the first and
the last, the ``comparison_shards`` rows the jobs of the middle one, all on the one queue (claim,
lease, retry up to ``max_job_attempts``: :mod:`api.jobs.comparisons`).

1. **split**: the worker that claims the comparison plans it (``accuracy.compare.plan_comparison``:
   open and align the bundles, nothing measured). When the aligned pairs hold ``shard_bytes`` of
   tensors or more (or a shard count was asked for on the row), it cuts them into ``shard_count``
   contiguous ranges of about equal bytes and, in one transaction, queues a shard per range and
   parks the comparison (``running``, no worker, no lease: nobody holds it and nobody can claim it).
   The plan's pair count and digest and the accepted comparisons whose history judges it are kept
   on the row (``shard_plan``), so every later phase re-plans the very same comparison.
2. **judge**: a worker claims a shard, re-plans from the same bundle files, checks the plan is the
   one that was split, judges its range (``judge_range``: reads the tensors, runs the metric kernels)
   and stores the results as JSON (:func:`accuracy.report.op_to_dict`, zlib); then it claims the next
   runnable shard of the same comparison, if any, and judges it in the same process with the plan open.
   The worker that split the comparison goes straight on to judge shards with the plan it made.
   Finishing a shard locks the comparison row; the finish that completes the last shard hands the
   comparison to its own worker, with a lease, as a claim would.
3. **merge**: that worker, its plan still open, reads the results of every shard in order
   (:func:`accuracy.report.op_from_dict`, the exact inverse), concludes (FDR over banded ops, unmatched,
   first divergence, counts) and persists exactly as an unsharded run does. Only one finish completes
   the shards, so the merge runs once; a merge whose worker dies is retried like any job (the claim
   that takes it over re-plans and checks the plan against the split's).

A shard that fails on its data fails the comparison with the error and cancels its other shards; so
does a shard whose workers keep dying (``max_job_attempts``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import zlib
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import lazyload

from accuracy.compare import ComparisonPlan, OpResult, repeated_measurements
from accuracy.errors import OpbandError
from accuracy.report import op_from_dict, op_to_dict
from api.settings import Settings
from api.store.db import Database
from api.store.models import Comparison, ComparisonShard, aware, utcnow

log = logging.getLogger("opband.jobs")

#: Fixed cost of one pair in bytes of tensor data, so ranges of many small ops balance too.
PAIR_OVERHEAD_BYTES = 64 << 10
SHARD_PLAN_SCHEMA = "opband.shard-plan/1"
RESULTS_SCHEMA = "opband.shard-results/1"


def is_shard(job_id: str) -> bool:
    """Shard ids are ``<comparison id>:<index>``; comparison ids have no colon."""
    return ":" in job_id


def shard_id(comparison_id: str, index: int) -> str:
    return f"{comparison_id}:{index}"


def comparison_of(job_id: str) -> str:
    return job_id.rsplit(":", 1)[0]


# -- planning ------------------------------------------------------------------------------------------
def pair_bytes(plan: ComparisonPlan) -> list[int]:
    """The tensor bytes each aligned pair reads (both sides, and the golden's where it has one); 0 for a pair
    that reuses an earlier pair's measurement (:func:`~accuracy.compare.repeated_measurements`: a module
    output that names its last op's stored tensors costs only its fixed share)."""
    def size(bundle: Any, name: str | None) -> int:
        info = bundle.tensors.get(name) if bundle is not None and name is not None else None
        return info.nbytes if info is not None else 0

    gold = plan.context.golden
    out = []
    for p, repeat in repeated_measurements(plan):  # one read of each pair's records
        if repeat:
            out.append(0)
            continue
        n = size(plan.ref, p.reference.tensor) + size(plan.tgt, p.target.tensor)
        if gold is not None and gold is not plan.ref:
            try:
                n += size(gold, gold.record(p.reference.id).tensor)
            except KeyError:
                pass
        out.append(n)
    return out


def split_ranges(weights: list[int], n: int) -> list[tuple[int, int]]:
    """``n`` contiguous, non-empty ranges ``[start, stop)`` of ``weights`` with about equal sums: the k-th cut
    is the pair boundary nearest to ``k / n`` of the total (each weight plus :data:`PAIR_OVERHEAD_BYTES`)."""
    n = max(1, min(n, len(weights)))
    cum = [0]
    for w in weights:
        cum.append(cum[-1] + w + PAIR_OVERHEAD_BYTES)
    cuts = [0]
    for k in range(1, n):
        goal = cum[-1] * k / n
        i = bisect.bisect_left(cum, goal)  # cum[i - 1] < goal <= cum[i]
        if i > 0 and goal - cum[i - 1] <= cum[i] - goal:
            i -= 1
        # at least one pair since the last cut, and one for each later range
        cuts.append(min(max(i, cuts[-1] + 1), len(weights) - (n - k)))
    cuts.append(len(weights))
    return [(cuts[j], cuts[j + 1]) for j in range(n)]


def shard_count(settings: Settings, requested: int | None, total_bytes: int, pairs: int) -> int:
    """How many shards a comparison gets: the count asked for on its row, else ``shard_count`` when its pairs
    hold at least ``shard_bytes`` of tensors (0: never by size), else 1; never more than it has pairs."""
    if requested:
        n = requested
    elif settings.shard_bytes and total_bytes >= settings.shard_bytes:
        n = settings.shard_count
    else:
        n = 1
    return max(1, min(n, pairs))


def plan_digest(plan: ComparisonPlan) -> str:
    """A fingerprint of what a plan pairs (and leaves unmatched), in order: every shard and the merge check
    theirs against the split's, so workers of another version or changed bundles cannot mix results."""
    h = hashlib.sha256(plan.mode.encode())
    for p in plan.pairs:
        h.update(f"\n{p.reference.id}\t{p.target.id}\t{p.how}".encode())
    h.update(b"\n--")
    for u in plan.unmatched:
        h.update(f"\n{u.side}\t{u.record.id}".encode())
    return h.hexdigest()


def check_plan(plan: ComparisonPlan, shard_plan: dict[str, Any]) -> None:
    if len(plan.pairs) != shard_plan["pairs"] or plan_digest(plan) != shard_plan["digest"]:
        raise OpbandError(
            f"the comparison was split into shards over {shard_plan['pairs']} aligned pairs, but re-planning it now "
            f"gives {len(plan.pairs)} (or other pairs): its bundles, or the opband version of the workers, changed "
            "between the shards. Queue the comparison again")


# -- results ---------------------------------------------------------------------------------------------
def encode_results(results: list[OpResult]) -> bytes:
    """A shard's judged ops as zlib-compressed JSON (never pickle)."""
    doc = {"schema": RESULTS_SCHEMA, "ops": [op_to_dict(o) for o in results]}
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)


def decode_results(blob: bytes) -> list[OpResult]:
    doc = json.loads(zlib.decompress(blob))
    if doc.get("schema") != RESULTS_SCHEMA:
        raise OpbandError(f"shard results of schema {doc.get('schema')!r}, this opband reads {RESULTS_SCHEMA}")
    return [op_from_dict(d) for d in doc["ops"]]


def load_results(db: Database, comparison_id: str, plan: ComparisonPlan) -> list[OpResult]:
    """Every shard's results, in pair order, checked to cover the plan's pairs exactly once."""
    with db.session() as s:
        rows = s.execute(select(ComparisonShard.index, ComparisonShard.start, ComparisonShard.stop,
                                ComparisonShard.status, ComparisonShard.results)
                         .where(ComparisonShard.comparison_id == comparison_id)
                         .order_by(ComparisonShard.index)).all()
    results: list[OpResult] = []
    for r in rows:
        if r.status != "done" or r.results is None or r.start != len(results):
            raise OpbandError(f"shard {r.index} of comparison {comparison_id} is {r.status} and holds no results for "
                              f"pairs {r.start}-{r.stop}: the merge cannot run")
        part = decode_results(r.results)
        if len(part) != r.stop - r.start or any(
                o.key != p.reference.key or o.output != p.reference.output
                for o, p in zip(part, plan.pairs[r.start:r.stop], strict=False)):
            raise OpbandError(f"shard {r.index} of comparison {comparison_id} holds results of other pairs")
        results += part
    if len(results) != len(plan.pairs):
        raise OpbandError(f"the shards of comparison {comparison_id} cover {len(results)} of {len(plan.pairs)} pairs")
    return results


# -- state changes (each one transaction; the comparison row is locked before any of its shards) -----------
def lock_comparison(s: Any, db: Database, comparison_id: str) -> Comparison | None:
    q = select(Comparison).where(Comparison.id == comparison_id).options(lazyload("*"))
    if db.engine.dialect.name == "postgresql":
        q = q.with_for_update()
    return s.scalar(q)


def held_by(row: Comparison | ComparisonShard | None, job_id: str, name: str, lost: str) -> bool:
    """Whether ``row`` is still running under worker ``name``; if not, logs ``lost`` (the result is dropped)."""
    if row is not None and row.status == "running" and row.worker == name:
        return True
    log.warning(lost, extra={"job_id": job_id, "worker": name})
    return False


def owned_shard(s: Any, db: Database, job_id: str, name: str) -> ComparisonShard | None:
    """The shard row, locked, if this worker still holds it."""
    q = select(ComparisonShard).where(ComparisonShard.id == job_id)
    if db.engine.dialect.name == "postgresql":
        q = q.with_for_update()
    shard = s.scalar(q)
    lost = "lost the shard: it was taken over or its comparison ended, dropping this result"
    return shard if held_by(shard, job_id, name, lost) else None


def park_for_shards(s: Any, job: Comparison, ranges: list[tuple[int, int]], weights: list[int],
                    shard_plan: dict[str, Any]) -> None:
    """Queue one shard per range and park the comparison (running, held by no worker) until they are judged."""
    for i, (start, stop) in enumerate(ranges):
        s.add(ComparisonShard(id=shard_id(job.id, i), comparison_id=job.id, index=i, start=start, stop=stop,
                              tensor_bytes=sum(weights[start:stop]), status="pending", attempts=0,
                              created_at=job.created_at))
    job.shards, job.shards_done, job.shard_plan = len(ranges), 0, shard_plan
    job.worker, job.lease_until = None, None
    log.info("comparison split into shards", extra={"job_id": job.id, "shards": len(ranges),
                                                     "pairs": shard_plan["pairs"], "bytes": shard_plan["bytes"]})


def finish_shard(s: Any, db: Database, job_id: str, blob: bytes, name: str, lease: timedelta) -> str:
    """Store a judged shard: ``"done"``; or ``"merge"`` when it completes the comparison's shards: the comparison
    is then this worker's to merge (running, under a ``lease`` like any claim), with its plan still open. If the
    worker dies before it has merged, the lease runs out and the next claim merges it."""
    job = lock_comparison(s, db, comparison_of(job_id))
    shard = owned_shard(s, db, job_id, name)
    if job is None or shard is None:
        return "lost"
    now = utcnow()
    shard.status, shard.results, shard.finished_at, shard.lease_until = "done", blob, now, None
    assert job.shards is not None and job.shards_done is not None
    job.shards_done += 1
    if job.shards_done < job.shards:
        return "done"
    job.status, job.worker, job.lease_until, job.attempts = "running", name, now + lease, 1
    log.info("shards judged: the worker of the last one merges", extra={"job_id": job.id, "shards": job.shards,
                                                                      "worker": name})
    return "merge"


def fail_comparison(s: Any, job: Comparison, error: str, now: Any) -> None:
    """Fail a sharded comparison and cancel its shards that have not finished."""
    if job.status in ("running", "pending"):
        job.status, job.error, job.finished_at, job.lease_until = "failed", error[:4000], now, None
    s.execute(update(ComparisonShard)
              .where(ComparisonShard.comparison_id == job.id, ComparisonShard.status.in_(("pending", "running")))
              .values(status="cancelled", lease_until=None, finished_at=now))


def fail_shard(s: Any, db: Database, job_id: str, error: str, name: str) -> str:
    """A shard failed on its data (or our bug): the comparison fails with the shard's error."""
    job = lock_comparison(s, db, comparison_of(job_id))
    shard = owned_shard(s, db, job_id, name)
    if job is None or shard is None:
        return "lost"
    now = utcnow()
    shard.status, shard.error, shard.finished_at, shard.lease_until = "failed", error[:4000], now, None
    fail_comparison(s, job, f"shard {shard.index + 1} of {job.shards} (pairs {shard.start}-{shard.stop}): {error}", now)
    return "failed"


def give_up_shard(s: Any, db: Database, job_id: str, attempts: int) -> bool:
    """A shard whose workers died ``attempts`` times fails, and with it the comparison. False when the shard
    changed meanwhile (another worker took or finished it)."""
    job = lock_comparison(s, db, comparison_of(job_id))
    q = select(ComparisonShard).where(ComparisonShard.id == job_id)
    if db.engine.dialect.name == "postgresql":
        q = q.with_for_update()
    shard = s.scalar(q)
    now = utcnow()
    if job is None or shard is None or shard.attempts != attempts or shard.status not in ("pending", "running") \
            or (shard.status == "running" and shard.lease_until is not None and aware(shard.lease_until) >= now):
        return False
    error = (f"gave up after {attempts} attempts: the worker running it stopped (crashed, killed or out of memory) "
             "each time; see the worker logs")
    shard.status, shard.error, shard.finished_at, shard.lease_until = "failed", error, now, None
    fail_comparison(s, job, f"shard {shard.index + 1} of {job.shards} (pairs {shard.start}-{shard.stop}): {error}", now)
    log.warning("shard given up", extra={"job_id": job_id, "attempts": attempts})
    return True
