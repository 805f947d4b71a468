"""Sharded comparisons (api.jobs.shards): split by op ranges on the job queue, judged by several workers,
merged once into exactly what an unsharded run stores. Real `opband worker` processes, real databases."""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
from service_fixtures import SynthOp, start_worker, write_bundle
from sqlalchemy import select

import accuracy
from accuracy.metrics import Metrics
from accuracy.report import op_from_dict, op_to_dict
from api.auth import get_or_create_project
from api.jobs import comparisons as jobs
from api.jobs import shards
from api.store.db import Database, upgrade
from api.store.ingest import SpooledUpload, store_bundle
from accuracy.compare import judge_range, plan_comparison
from api.store.models import BundleRow, Comparison, ComparisonShard, OpResultRow, Regression, Series
from api.services import Services
from api.settings import Settings

QUEUE_ENV = {"OPBAND_QUEUE": "database", "OPBAND_WORKERS": "0"}


# -- the exact inverse of op_to_dict ------------------------------------------------------------------------
def same(a: Any, b: Any) -> bool:
    """Equal values and types, NaN equal to NaN, dataclasses field by field."""
    if is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def round_trip(o: accuracy.OpResult) -> accuracy.OpResult:
    return op_from_dict(json.loads(json.dumps(op_to_dict(o))))


def _ops(n: int = 12) -> list[SynthOp]:
    return [SynthOp(f"model.layers.{i % 4}", op="aten.mm" if i % 3 else "aten.add", shape=(64, 8),
                    noise=[0.0, 1e-6, 1e-2, 0.3][i % 4], nan=i == 5) for i in range(n)]


def test_op_from_dict_round_trips_every_op_exactly(tmp_path: Path) -> None:
    ops = _ops()
    ref = write_bundle(tmp_path / "ref.bundle", ops)
    tgt = write_bundle(tmp_path / "tgt.bundle", ops[:-1] + [SynthOp("extra")], target=True)
    report = accuracy.compare(ref, tgt)
    # history of accepted runs: ops judged against bands (p-values, band checks) as well as budgets
    runs = [accuracy.compare(ref, write_bundle(tmp_path / f"h{k}.bundle", ops, target=True, seed=k)) for k in range(6)]
    history = {"schema": "opband.history/1", "results": [
        {"key": o.key, "output": o.output, "op": o.op, "shape_signature": o.shape_signature, "dtype": o.dtype,
         "target": "t", "run": f"r{k}", "metrics": o.metrics.as_dict()}
        for k, r in enumerate(runs) for o in r.ops if o.metrics is not None]}
    banded = accuracy.compare(ref, tgt, history=history, target_id="t")
    all_ops = report.ops + banded.ops
    assert any(o.bands for o in all_ops) and any(o.metrics is None for o in all_ops)
    assert any(o.metrics is not None and not o.metrics.finite_outcome for o in all_ops)
    for o in all_ops:
        back = round_trip(o)
        assert same(back, o), o.id
        assert json.dumps(op_to_dict(back)) == json.dumps(op_to_dict(o))


def test_metrics_from_dict_restores_non_finite_and_optional_fields() -> None:
    m = Metrics(numel=3, max_abs=math.inf, snr_db=-math.inf, cosine=math.nan, quantiles={"p50": math.inf},
                share_rel_over={"1e-03": 0.5}, histogram=[1, 2], mismatches=None, stats_delta={"mean": math.nan},
                source="summary")
    back = Metrics.from_dict(json.loads(json.dumps(m.as_dict())))
    assert same(back, m)
    assert same(Metrics.from_dict(Metrics(numel=4, mismatches=2).as_dict()), Metrics(numel=4, mismatches=2))
    with pytest.raises(ValueError, match="unknown metrics field"):
        Metrics.from_dict({"numel": 1, "bogus": 2})


def test_split_ranges_are_contiguous_balanced_and_non_empty() -> None:
    assert shards.split_ranges([10] * 10, 3)[0][0] == 0
    for weights, n in (([1 << 20] * 100, 8), ([0] * 5, 8), ([1 << 30] + [1] * 9, 4), ([1] * 9 + [1 << 30], 4),
                       ([5, 1 << 28, 7, 1 << 28, 3], 2)):
        ranges = shards.split_ranges(weights, n)
        assert len(ranges) == min(n, len(weights))
        assert ranges[0][0] == 0 and ranges[-1][1] == len(weights)
        assert all(a < b for a, b in ranges) and all(r[1] == q[0] for r, q in zip(ranges, ranges[1:], strict=False))
    even = shards.split_ranges([1 << 20] * 100, 8)
    assert max(b - a for a, b in even) - min(b - a for a, b in even) <= 1
    assert shards.split_ranges([5, 1 << 28, 7, 1 << 28, 3], 2) == [(0, 2), (2, 5)]


def test_pair_bytes_weigh_a_shared_tensor_pair_once(tmp_path: Path) -> None:
    """Records that name the same stored tensors on both sides are measured once per comparison, so the
    shard split weighs them once: a later one costs only its fixed share."""
    import numpy as np

    from accuracy.bundle import BundleWriter
    from accuracy.compare import repeated_measurements
    from accuracy.manifest import Manifest, Record

    def bundle(path: Path, noise: float) -> Path:
        with BundleWriter(path) as w:
            for i in range(2):
                w.add_array(f"t{i}", (np.arange(16, dtype=np.float32) + i) * np.float32(1 + noise))
            recs = [Record(key=f"{m}/aten.mm#0", module=m, op="aten.mm", index=k, shape=[16], dtype="float32", tensor=t)
                    for k, (m, t) in enumerate((("a", "t0"), ("b", "t0"), ("c", "t1"), ("d", "t1")))]
            return w.close(Manifest(run={"variant": "fp32", "device": "cpu"}, records=recs))

    plan = plan_comparison(bundle(tmp_path / "r.bundle", 0.0), bundle(tmp_path / "t.bundle", 1e-3))
    assert [p.reference.module for p in plan.pairs] == ["a", "b", "c", "d"]
    assert [repeat for _, repeat in repeated_measurements(plan)] == [False, True, False, True]
    assert shards.pair_bytes(plan) == [128, 0, 128, 0]  # 16 float32 a side, then nothing for the repeat
    judged = judge_range(plan, 0, 4)
    assert judged[0].metrics == judged[1].metrics and judged[2].metrics == judged[3].metrics
    assert judged[0].metrics is not None and judged[0].metrics.max_abs > 0


# -- a service on a real database, bundles stored, comparisons queued -------------------------------------------
class Service:
    def __init__(self, tmp: Path, url: str) -> None:
        upgrade(url)
        self.data_dir, self.url = tmp / "data", url
        self.settings = Settings(database_url=url, data_dir=self.data_dir, workers=0, job_lease_seconds=5,
                                 job_in_child_process=False)
        self.svc = Services.open(self.settings)
        self.db: Database = self.svc.db
        self.tmp = tmp
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def bundle(self, project: str, path: Path) -> str:
        proj = get_or_create_project(self.db, project)
        spool = self.tmp / f"{uuid.uuid4().hex}.up"
        shutil.copy(path, spool)
        data = path.read_bytes()
        return store_bundle(self.db, self.svc.store, proj,
                            SpooledUpload(spool, hashlib.sha256(data).hexdigest(), len(data)))[0].id

    def queue(self, project: str, ref: str, tgt: str, shards_asked: int | None = None) -> str:
        proj = get_or_create_project(self.db, project)
        with self.db.session() as s:
            c = Comparison(id=uuid.uuid4().hex, project_id=proj.id, reference_id=ref, target_id=tgt,
                           shards=shards_asked)
            s.add(c)
        return c.id

    def worker(self, name: str, lease: int = 5,
               env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
        w = start_worker(self.data_dir, self.url, {**QUEUE_ENV, "OPBAND_JOB_LEASE_SECONDS": str(lease), **(env or {})},
                         log_name=name)
        self.procs.append(w)
        return w

    def row(self, job_id: str) -> Comparison:
        with self.db.session() as s:
            c = s.get(Comparison, job_id)
            assert c is not None
            return c

    def shard_rows(self, job_id: str) -> list[ComparisonShard]:
        with self.db.session() as s:
            return list(s.scalars(select(ComparisonShard).where(ComparisonShard.comparison_id == job_id)
                                  .order_by(ComparisonShard.index)))

    def wait(self, *ids: str, timeout: float = 180) -> list[Comparison]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = [self.row(i) for i in ids]
            if all(r.status in ("done", "failed") for r in rows):
                return rows
            time.sleep(0.2)
        raise AssertionError(f"not finished after {timeout}s: {[(r.id, r.status) for r in rows]}")

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.svc.close()


@pytest.fixture
def service(tmp_path: Path, database_url: str):  # type: ignore[no-untyped-def]
    svc = Service(tmp_path, database_url)
    try:
        yield svc
    finally:
        svc.close()


def pair(service: Service, project: str, ops: list[SynthOp], tgt_ops: list[SynthOp] | None = None) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:6]
    ref = write_bundle(service.tmp / f"ref-{tag}.bundle", ops)
    tgt = write_bundle(service.tmp / f"tgt-{tag}.bundle", tgt_ops if tgt_ops is not None else ops, target=True)
    return service.bundle(project, ref), service.bundle(project, tgt)


def stored(db: Database, job_id: str) -> dict[str, Any]:
    """What a finished comparison left in the database, without ids and times."""
    with db.session() as s:
        c = s.get(Comparison, job_id)
        assert c is not None
        skip = {"id", "comparison_id", "series_id", "created_at"}
        rows = [{k: v for k, v in r.__dict__.items() if not k.startswith("_") and k not in skip}
                for r in s.scalars(select(OpResultRow).where(OpResultRow.comparison_id == job_id)
                                   .order_by(OpResultRow.index, OpResultRow.key, OpResultRow.output))]
        series = sorted((x.key, x.shape_signature, x.dtype, x.worst_severity)
                        for x in s.scalars(select(Series).where(Series.project_id == c.project_id)))
        regs = sorted((r.key, r.status, r.reason, r.first_comparison_id == job_id, r.last_comparison_id == job_id)
                      for r in s.scalars(select(Regression).where(Regression.project_id == c.project_id)))
        return {"status": c.status, "verdict": c.verdict, "counts": c.counts, "first_divergence": c.first_divergence,
                "unmatched": c.unmatched, "error": c.error, "rows": rows, "series": series, "regressions": regs}


def test_sharded_result_equals_unsharded(service: Service) -> None:
    ops = _ops(40)
    tgt_ops = ops[:30] + ops[31:] + [SynthOp("model.extra")]  # one record missing, one new
    whole = service.queue("whole", *pair(service, "whole", ops, tgt_ops), shards_asked=1)  # never split
    split = service.queue("split", *pair(service, "split", ops, tgt_ops), shards_asked=5)
    auto = service.queue("auto", *pair(service, "auto", ops, tgt_ops))
    service.worker("w1")
    service.worker("w2", env={"OPBAND_SHARD_BYTES": "1", "OPBAND_SHARD_COUNT": "3"})
    done = service.wait(whole, split, auto)
    assert [c.status for c in done] == ["done"] * 3, [c.error for c in done]
    expected = stored(service.db, whole)
    assert expected["verdict"] == "fail" and expected["first_divergence"] and expected["unmatched"] >= 2
    assert expected["regressions"] and len(expected["rows"]) >= 40
    assert stored(service.db, split) == expected
    assert service.row(whole).shards_done is None and service.row(split).shards == 5
    rows = service.shard_rows(split)
    assert [(s.status, s.results, s.attempts) for s in rows] == [("done", None, 1)] * 5, "results dropped once merged"
    assert rows[0].start == 0 and all(a.stop == b.start for a, b in zip(rows, rows[1:], strict=False))
    sizes = [s.stop - s.start for s in rows]  # equal tensors: equal ranges
    assert rows[-1].stop == service.row(split).shard_plan["pairs"] and max(sizes) - min(sizes) <= 1, sizes
    if service.row(auto).shards is not None:  # w2 (OPBAND_SHARD_BYTES=1) split it into its 3 shards
        assert service.row(auto).shards == 3
    assert stored(service.db, auto) == expected


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    kids = [int(x) for x in out]
    return kids + [k for kid in kids for k in _descendants(kid)]


def test_killed_shard_is_retried_and_the_result_is_whole(service: Service) -> None:
    # shards of 12k records take about a second: the kill lands while the victim's job process is in one (with
    # 3k, a fast machine finished the shard within the job process's 0.2 s watch of its worker, and nothing was retried)
    ops = [SynthOp(f"model.layers.{i % 50}", shape=(16,), noise=1e-2 if i % 97 == 0 else 0.0) for i in range(24000)]
    ref, tgt = pair(service, "p", ops)
    expected_job = service.queue("p", ref, tgt)
    job = service.queue("p", ref, tgt, shards_asked=2)
    victim, _ = service.worker("victim")
    assert service.wait(expected_job)[0].status == "done"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until the victim holds a shard of the job
        held = [s for s in service.shard_rows(job)
                if s.status == "running" and s.worker and f":{victim.pid}:" in s.worker]
        if held:
            break
        time.sleep(0.02)
    assert held, "the victim never took a shard"
    job_processes = _descendants(victim.pid)
    os.kill(victim.pid, signal.SIGKILL)  # its job process notices and ends too: the shard is left to its lease
    victim.wait(10)
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]
              for pid in job_processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    service.worker("rescuer")
    result = service.wait(job)[0]
    assert result.status == "done", result.error
    retried = [s for s in service.shard_rows(job) if s.index == held[0].index][0]
    assert retried.attempts == 2 and f":{victim.pid}:" not in (retried.worker or "")
    got, want = stored(service.db, job), stored(service.db, expected_job)
    assert len(got["rows"]) == len(ops) and got["rows"] == want["rows"] and got["counts"] == want["counts"]
    assert got["first_divergence"] == want["first_divergence"]


def run_unsharded(service: Service, ref: str, tgt: str) -> str:
    """Queue and run, in this process, the comparison of ``ref`` and ``tgt`` that is never split: the expected result."""
    job = service.queue("p", ref, tgt, shards_asked=1)
    assert jobs.claim_next(service.db, service.settings, "w") == job
    assert jobs.run_job(service.db, service.svc.store, service.settings, job, "w") == "done"
    return job


def judged_shards(service: Service, ref: str, tgt: str, job: str) -> list[bytes]:
    """Each shard of ``job`` judged here, as the results blob its worker would store."""
    with service.db.session() as s:
        keys = [s.get(BundleRow, b).storage_key for b in (ref, tgt)]  # type: ignore[union-attr]
    with service.svc.store.local_path(keys[0]) as rp, service.svc.store.local_path(keys[1]) as tp:
        plan = plan_comparison(rp, tp)
        return [shards.encode_results(judge_range(plan, r.start, r.stop)) for r in service.shard_rows(job)]


def split_only(service: Service, job: str, settings: Settings | None = None) -> None:
    """Claim and split ``job`` in this process without judging its shards (a splitter goes on to judge them;
    here other workers are to): the shards are left pending."""
    settings = settings or service.settings
    assert jobs.claim_next(service.db, settings, "splitter") == job
    real = jobs._judge_more_shards
    jobs._judge_more_shards = lambda *a, **k: ("done", False)  # type: ignore[assignment]
    try:
        assert jobs.run_job(service.db, service.svc.store, settings, job, "splitter") == "sharded"
    finally:
        jobs._judge_more_shards = real  # type: ignore[assignment]


def _finish_in_process(url: str, data_dir: str, job_id: str, name: str, blob: bytes, barrier: Any, out: Any) -> None:
    """One of two workers finishing its (last) shard at the same moment as the other."""
    settings = Settings(database_url=url, data_dir=Path(data_dir), job_in_child_process=False)
    db = Database(settings)
    try:
        barrier.wait(30)
        out.put((name, jobs._finish_shard(db, settings, job_id, blob, name)))
    finally:
        db.dispose()


def _claim_in_process(url: str, data_dir: str, name: str, barrier: Any, out: Any) -> None:
    settings = Settings(database_url=url, data_dir=Path(data_dir), job_in_child_process=False)
    db = Database(settings)
    try:
        barrier.wait(30)
        out.put((name, jobs.claim_next(db, settings, name)))
    finally:
        db.dispose()


def _race(target: Any, args: list[tuple[Any, ...]]) -> list[tuple[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(len(args)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, out)) for a in args]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


def test_two_workers_racing_on_the_last_shards_and_the_merge_merge_once(service: Service) -> None:
    ops = _ops(30)
    ref, tgt = pair(service, "p", ops)
    expected = run_unsharded(service, ref, tgt)
    job = service.queue("p", ref, tgt, shards_asked=3)
    # split it, and judge the first shard, in this process; then hold the other two as two workers
    split_only(service, job)
    first, *held = [jobs.claim_next(service.db, service.settings, f"w{i}") for i in range(3)]
    assert [first, *held] == [shards.shard_id(job, i) for i in range(3)]
    # w0 judges its shard (and finds no other to go on with: both are held)
    assert jobs.run_job(service.db, service.svc.store, service.settings, first, "w0") == "done"
    assert service.row(job).status == "running" and service.row(job).shards_done == 1
    # both finish at once (judged here, stored there): exactly one of them completes the shards and queues the merge
    blobs = judged_shards(service, ref, tgt, job)[1:]
    finished = _race(_finish_in_process, [(service.url, str(service.data_dir), held[i], f"w{i + 1}", blobs[i])
                                          for i in range(2)])
    assert sorted(s for _, s in finished) == ["done", "merge"], finished
    winner = next(n for n, s in finished if s == "merge")
    row = service.row(job)
    assert (row.status, row.shards_done, row.worker) == ("running", 3, winner) and row.lease_until is not None
    # the merge is the winner's, under its lease: four workers claiming at once get nothing
    claims = _race(_claim_in_process, [(service.url, str(service.data_dir), f"m{i}") for i in range(4)])
    assert [got for _, got in claims] == [None] * 4, claims
    assert jobs.run_job(service.db, service.svc.store, service.settings, job, winner) == "done"
    assert jobs.claim_next(service.db, service.settings, "late") is None, "nothing left to claim: merged once"
    assert stored(service.db, job)["rows"] == stored(service.db, expected)["rows"]
    assert service.row(job).attempts == 1


def test_a_merger_that_dies_leaves_the_merge_to_the_next_claim(service: Service) -> None:
    """The worker that finished the last shard died before it merged: once its lease runs out, a claim takes
    the merge over, re-plans, and stores exactly the unsharded result."""
    from datetime import timedelta

    from api.store.models import utcnow

    ops = _ops(20)
    ref, tgt = pair(service, "p", ops)
    expected = run_unsharded(service, ref, tgt)
    job = service.queue("p", ref, tgt, shards_asked=2)
    split_only(service, job)
    ids = [jobs.claim_next(service.db, service.settings, "dies") for _ in range(2)]
    statuses = [jobs._finish_shard(service.db, service.settings, i, blob, "dies")
                for i, blob in zip(ids, judged_shards(service, ref, tgt, job), strict=True)]
    assert statuses == ["done", "merge"]
    assert jobs.claim_next(service.db, service.settings, "rescuer") is None, "the merge is held under a lease"
    with service.db.session() as s:  # ... which runs out: the worker died before merging
        row = s.get(Comparison, job)
        assert row is not None
        row.lease_until = utcnow() - timedelta(seconds=1)
    assert jobs.claim_next(service.db, service.settings, "rescuer") == job
    assert jobs.run_job(service.db, service.svc.store, service.settings, job, "rescuer") == "done"
    got, want = stored(service.db, job), stored(service.db, expected)
    assert {k: got[k] for k in ("status", "verdict", "counts", "first_divergence", "rows")} == \
        {k: want[k] for k in ("status", "verdict", "counts", "first_divergence", "rows")}
    assert service.row(job).attempts == 2


def test_merge_races_in_real_workers_merge_each_comparison_once(service: Service) -> None:
    ops = _ops(24)
    ref, tgt = pair(service, "p", ops)
    ids = [service.queue("p", ref, tgt, shards_asked=4) for _ in range(6)]
    logs = [service.worker(f"w{i}")[1] for i in range(3)]
    done = service.wait(*ids)
    assert all(c.status == "done" and c.counts == done[0].counts for c in done), [c.error for c in done]
    with service.db.session() as s:
        for i in ids:
            assert s.query(OpResultRow).filter(OpResultRow.comparison_id == i).count() == len(ops)
    time.sleep(1.0)  # the last "job started" lines reach the logs
    merges = [json.loads(line)["job_id"] for log in logs for line in log.read_text().splitlines()
              if line.startswith("{") and json.loads(line).get("message") == "job started"
              and json.loads(line).get("phase") == "merge"]
    assert sorted(merges) == sorted(ids), "each comparison merged exactly once"


def test_a_shard_failing_on_its_data_fails_the_comparison(service: Service) -> None:
    ops = _ops(30)
    ref, tgt = pair(service, "p", ops)
    job = service.queue("p", ref, tgt, shards_asked=3)
    split_only(service, job)
    with service.db.session() as s:  # the target's blob is damaged after the split
        key = s.get(BundleRow, tgt).storage_key  # type: ignore[union-attr]
    with service.svc.store.local_path(key) as path:
        damaged = Path(path)
    os.chmod(damaged, 0o644)
    with open(damaged, "r+b") as f:
        f.truncate(100)
    service.worker("w1")
    result = service.wait(job)[0]
    assert result.status == "failed" and result.error.startswith("shard 1 of 3 (pairs 0-10): BundleError"), result.error
    states = [s.status for s in service.shard_rows(job)]
    assert states[0] == "failed" and set(states[1:]) <= {"cancelled", "failed"}, states
    with service.db.session() as s:
        assert s.query(OpResultRow).filter(OpResultRow.comparison_id == job).count() == 0


def test_a_shard_whose_workers_keep_dying_gives_up_and_fails_the_comparison(service: Service) -> None:
    from datetime import timedelta

    from api.store.models import utcnow

    settings = service.settings.model_copy(update={"max_job_attempts": 1})
    job = service.queue("p", *pair(service, "p", _ops(30)), shards_asked=3)
    split_only(service, job, settings)
    assert jobs.claim_next(service.db, settings, "dies") == shards.shard_id(job, 0)
    with service.db.session() as s:  # its worker died: the lease runs out
        row = s.get(ComparisonShard, shards.shard_id(job, 0))
        assert row is not None
        row.lease_until = utcnow() - timedelta(seconds=1)
    assert jobs.claim_next(service.db, settings, "next") is None, "given up, not claimed again"
    result = service.row(job)
    assert result.status == "failed" and result.error.startswith("shard 1 of 3 (pairs 0-10): gave up after 1 attempts")
    assert [s.status for s in service.shard_rows(job)] == ["failed", "cancelled", "cancelled"]
    assert jobs.claim_next(service.db, settings, "next") is None, "nothing of a failed comparison is left to run"
