"""Scale-out comparison workers: `opband worker` processes claiming leased rows of PostgreSQL's comparisons table."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import httpx
import psycopg
import pytest
from service_fixtures import (
    LiveServer, SynthOp, start_server, start_worker, stop_server, upload_bytes, wait_done, write_bundle,
)

QUEUE_ENV = {"OPBAND_QUEUE": "database", "OPBAND_WORKERS": "0"}


@pytest.fixture
def api(tmp_path: Path, pg_url: str):  # type: ignore[no-untyped-def]
    """The API with no in-process workers (jobs only run in `opband worker` processes)."""
    server = start_server(tmp_path / "data", pg_url, QUEUE_ENV)
    workers: list = []  # type: ignore[type-arg]
    server.workers = workers  # type: ignore[attr-defined]
    try:
        yield server
    finally:
        for proc, _ in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in workers:
            try:
                proc.wait(20)
            except Exception:  # noqa: BLE001
                proc.kill()
        stop_server(server)


def spawn(server: LiveServer, name: str, lease: int = 600) -> tuple:  # type: ignore[type-arg]
    w = start_worker(server.data_dir, server.database_url,
                     {**QUEUE_ENV, "OPBAND_JOB_LEASE_SECONDS": str(lease)}, log_name=name)
    server.workers.append(w)  # type: ignore[attr-defined]
    return w


def pair(c: httpx.Client, tmp: Path, ops: list[SynthOp], project: str = "w") -> tuple[str, str]:
    ref = upload_bytes(c, project, write_bundle(tmp / "ref.bundle", ops).read_bytes())
    tgt = upload_bytes(c, project, write_bundle(tmp / "tgt.bundle", ops, target=True).read_bytes())
    assert ref.status_code in (200, 201) and tgt.status_code in (200, 201), (ref.text, tgt.text)
    return ref.json()["id"], tgt.json()["id"]


def queue(c: httpx.Client, ref: str, tgt: str, mode: str = "propagated", project: str = "w") -> str:
    r = c.post(f"/api/v1/projects/{project}/comparisons", json={"reference": ref, "target": tgt, "mode": mode})
    assert r.status_code == 202, r.text
    return r.json()["id"]  # type: ignore[no-any-return]


def log_events(path: Path, message: str) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("message") == message:
                out.append(event)
    return out


def test_many_jobs_two_workers_each_exactly_once(api: LiveServer, tmp_path: Path) -> None:
    ops = [SynthOp(f"model.layers.{i % 20}", shape=(256,), noise=1e-2 if i % 7 == 0 else 0.0) for i in range(400)]
    with api.client() as c:
        ref, tgt = pair(c, tmp_path, ops)
        first = queue(c, ref, tgt)
        time.sleep(2.0)
        assert c.get(f"/api/v1/comparisons/{first}").json()["status"] == "pending", \
            "with OPBAND_WORKERS=0 the API must not run jobs itself"
        ids = [first] + [queue(c, ref, tgt) for _ in range(15)]
        (p1, log1), (p2, log2) = spawn(api, "w1"), spawn(api, "w2")
        done = [wait_done(c, i, timeout=180) for i in ids]
        assert all(d["status"] == "done" and d["attempts"] == 1 for d in done), [(d["status"], d["error"]) for d in done]
        assert all(d["counts"]["fail"] > 0 and d["verdict"] == "fail" for d in done)
        assert c.get(f"/api/v1/comparisons/{first}/ops").json()["count"] == len(ops)
    # a worker logs "job finished" just after the job's row says done (its child process has exited):
    # give the last line a moment to reach the log before counting
    deadline = time.monotonic() + 15
    while True:
        finished = log_events(log1, "job finished") + log_events(log2, "job finished")
        if len(finished) >= len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert Counter(e["job_id"] for e in finished) == Counter(ids), "every job must run exactly once"
    assert {e["worker"].split(":")[1] for e in finished} == {str(p1.pid), str(p2.pid)}, "both workers must take jobs"
    started = log_events(log1, "job started") + log_events(log2, "job started")
    assert Counter(e["job_id"] for e in started) == Counter(ids)


def _job_row(url: str, job_id: str) -> tuple[str, str | None, int]:
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        row = conn.execute("SELECT status, worker, attempts FROM comparisons WHERE id = %s", (job_id,)).fetchone()
    assert row is not None
    return row  # type: ignore[return-value]


def test_killed_worker_job_is_retried_after_lease(api: LiveServer, tmp_path: Path) -> None:
    ops = [SynthOp(f"model.layers.{i % 50}", shape=(16,)) for i in range(8000)]
    with api.client() as c:
        ref, tgt = pair(c, tmp_path, ops)
        job = queue(c, ref, tgt)
        victim, _ = spawn(api, "victim", lease=5)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, worker, _ = _job_row(api.database_url, job)
            if status == "running" and worker and f":{victim.pid}:" in worker:
                break
            assert status == "pending", f"the job got to {status} before it could be killed"
            time.sleep(0.02)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        assert _job_row(api.database_url, job)[0] == "running", "the killed worker's job keeps its lease until it expires"
        rescuer, rescuer_log = spawn(api, "rescuer", lease=5)
        result = wait_done(c, job, timeout=120)
        assert result["status"] == "done" and result["attempts"] == 2, result
        _, worker, _ = _job_row(api.database_url, job)
        assert worker and f":{rescuer.pid}:" in worker
        assert c.get(f"/api/v1/comparisons/{job}/ops").json()["count"] == len(ops), "no duplicate or partial results"
    retried = log_events(rescuer_log, "retrying a job whose lease expired")
    assert retried and retried[0]["job_id"] == job


def test_deterministic_failure_ends_failed_with_error(api: LiveServer, tmp_path: Path) -> None:
    ops = [SynthOp(f"model.layers.{i}") for i in range(5)]
    with api.client() as c:
        ref, tgt = pair(c, tmp_path, ops)
        spawn(api, "w1", lease=5)
        spawn(api, "w2", lease=5)
        other = upload_bytes(c, "w", write_bundle(tmp_path / "other.bundle", [SynthOp("elsewhere")], target=True)
                             .read_bytes()).json()["id"]
        job = queue(c, ref, other)  # no record aligns: fails the same way on every attempt
        result = wait_done(c, job, timeout=60)
        assert result["status"] == "failed" and result["attempts"] == 1, result
        assert "nothing to compare" in result["error"] and "internal error" not in result["error"], result["error"]
        time.sleep(6)  # past a lease: a failed job is never picked up again
        assert c.get(f"/api/v1/comparisons/{job}").json()["attempts"] == 1
        ok = wait_done(c, queue(c, ref, tgt), timeout=60)
        assert ok["status"] == "done", "a failed job must not stop the workers"


def test_worker_serves_its_own_metrics(api: LiveServer, tmp_path: Path) -> None:
    """Jobs run in `opband worker` processes are counted there: each worker serves /metrics."""
    from api.server import free_port

    port = free_port()
    proc, log = start_worker(api.data_dir, api.database_url,
                             {**QUEUE_ENV, "OPBAND_WORKER_METRICS_PORT": str(port)}, log_name="metrics")
    api.workers.append((proc, log))  # type: ignore[attr-defined]
    ops = [SynthOp(f"model.layers.{i}") for i in range(3)]
    with api.client() as c:
        ref, tgt = pair(c, tmp_path, ops)
        assert wait_done(c, queue(c, ref, tgt), timeout=60)["status"] == "done"
    # The job's row says done as soon as its child process commits; the worker counts the job once the
    # child has exited and the pool shut down, a moment later (seconds on a loaded 2-core machine).
    finished = 'opband_jobs_finished_total{status="done"} 1.0'
    deadline, text = time.monotonic() + 30, ""
    while finished not in text:
        assert time.monotonic() < deadline and proc.poll() is None, (text[-3000:], log.read_text()[-2000:])
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    assert 'opband_comparison_duration_seconds_count{status="done"} 1.0' in text
    assert 'opband_jobs{status="done"} 1.0' in text  # read from the shared table at scrape time
    assert f"worker metrics at http://127.0.0.1:{port}/metrics" in log.read_text()


def test_a_comparison_asked_for_in_shards_is_split_judged_by_two_workers_and_merged(api: LiveServer,
                                                                                   tmp_path: Path) -> None:
    ops = [SynthOp(f"model.layers.{i % 8}", shape=(128,), noise=1e-2 if i % 11 == 0 else 0.0) for i in range(60)]
    with api.client() as c:
        ref, tgt = pair(c, tmp_path, ops)
        bad = c.post("/api/v1/projects/w/comparisons", json={"reference": ref, "target": tgt, "shards": 0})
        assert bad.status_code == 422 and "shards" in bad.text
        whole = c.post("/api/v1/projects/w/comparisons", json={"reference": ref, "target": tgt, "shards": 1}).json()
        split = c.post("/api/v1/projects/w/comparisons", json={"reference": ref, "target": tgt, "shards": 4}).json()
        assert split["status"] == "pending" and split["shards"] == 4 and split["shards_done"] is None
        spawn(api, "s1")
        spawn(api, "s2")
        done = {k: wait_done(c, job["id"]) for k, job in (("whole", whole), ("split", split))}
    assert done["split"]["status"] == done["whole"]["status"] == "done", done
    assert (done["split"]["shards"], done["split"]["shards_done"]) == (4, 4)
    assert done["whole"]["shards_done"] is None  # one shard asked for: never split
    for field in ("verdict", "counts", "first_divergence", "unmatched"):
        assert done["split"][field] == done["whole"][field], field
    assert done["split"]["counts"]["fail"] >= 1
