"""Service benchmark (not a test): ingest throughput and memory, and query cost as the database grows.

1. Ingest: upload a 100 MB and a 1 GB bundle (BundleWriter, random float32) to a live ``opband
   serve``; report upload time as a ratio to a raw streamed disk write of the same bytes, and the
   server's peak RSS (VmHWM) per size: it must not grow with the bundle.
2. Queries on PostgreSQL at 10^4 and 10^6 stored op results (COPY-loaded synthetic rows): per-op
   results of one comparison, regressions, drift (worst series and one key). A ratio near 1 means
   indexes, not scans; EXPLAIN plans are printed for the 10^6 case.

Run: ``.venv/bin/python benchmarks/service.py [--skip-ingest] [--skip-queries]``. Needs PostgreSQL
at OPBAND_TEST_PG (default postgresql://postgres@127.0.0.1:5432/test) and ~2.5 GB of free disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from accuracy.bundle import BundleWriter  # noqa: E402
from accuracy.manifest import Manifest, Record  # noqa: E402

PG_ADMIN = os.environ.get("OPBAND_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
TENSOR = 4 << 20  # float32 elements per tensor (16 MB)


def build_bundle(path: Path, nbytes: int) -> Path:
    rng = np.random.default_rng(0)
    records = []
    with BundleWriter(path) as w:
        for i in range(max(1, nbytes // (TENSOR * 4))):
            w.add_array(f"t{i}", rng.standard_normal(TENSOR, dtype=np.float32))
            records.append(Record(key=f"model.layers.{i}/aten.mm#0", module=f"model.layers.{i}", op="aten.mm",
                                  index=i, input_shapes=[[TENSOR]], shape=[TENSOR], dtype="float32", tensor=f"t{i}"))
        return w.close(Manifest(run={"variant": "fp32", "device": "cpu"}, records=records))


def raw_write_seconds(src: Path, dst: Path) -> float:
    """A streamed copy in 1 MB chunks: the floor for any ingest that must land bytes on disk."""
    started = time.perf_counter()
    with open(src, "rb") as f, open(dst, "wb") as out:
        while chunk := f.read(1 << 20):
            out.write(chunk)
    seconds = time.perf_counter() - started
    dst.unlink()
    return seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def ingest(size: int, work: Path) -> tuple[float, float, float]:
    """(upload seconds, raw write seconds, server peak RSS MB) for one bundle of ``size`` bytes."""
    bundle = build_bundle(work / f"b{size}.bundle", size)
    raw = raw_write_seconds(bundle, work / "raw.copy")
    data = work / f"data{size}"
    port = free_port()
    env = {**os.environ, "OPBAND_DATA_DIR": str(data), "OPBAND_WORKERS": "0", "OPBAND_LOG_LEVEL": "warning"}
    env.pop("OPBAND_DATABASE_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "opband.cli", "serve", "--port", str(port), "--data-dir", str(data)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/api/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)

        def body():  # type: ignore[no-untyped-def]
            with open(bundle, "rb") as f:
                while chunk := f.read(1 << 20):
                    yield chunk

        started = time.perf_counter()
        r = httpx.post(f"{url}/api/v1/projects/bench/bundles", content=body(), timeout=600,
                       headers={"Content-Length": str(bundle.stat().st_size)})
        seconds = time.perf_counter() - started
        assert r.status_code == 201, r.text
        rss = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
        bundle.unlink(missing_ok=True)
        shutil.rmtree(data, ignore_errors=True)
    return seconds, raw, rss


# --- queries ---------------------------------------------------------------------------------------

OPS_PER_COMPARISON = 1000


def load(url: str, results: int) -> None:
    """Synthetic history: one project, 2 bundles, results/1000 comparisons of 1000 ops, 1000 series."""
    import psycopg

    from api.store.db import upgrade

    upgrade(url)
    comparisons = results // OPS_PER_COMPARISON
    now = datetime.now(UTC)
    rng = np.random.default_rng(0)
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO projects (name, public, created_at) VALUES ('bench', false, now()) RETURNING id")
        pid = cur.fetchone()[0]  # type: ignore[index]
        for b in ("ref", "tgt"):
            cur.execute("INSERT INTO bundles (id, project_id, sha256, size, storage_key, variant, device, records, run,"
                        " environment, created_at) VALUES (%s, %s, %s, 1, 'x', 'bf16', 'cpu', 0, '{}', '{}', now())",
                        (b, pid, b * 10))
        with cur.copy("COPY series (project_id, key, op, shape_signature, dtype, target, worst_severity) FROM STDIN") as cp:
            for i in range(OPS_PER_COMPARISON):
                cp.write_row((pid, f"model.layers.{i // 10}.mlp/aten.mm#{i % 10}", "aten.mm", "64x128", "float32",
                              "bf16@cpu", float(rng.random())))
        cur.execute("SELECT id FROM series WHERE project_id = %s ORDER BY id", (pid,))
        series = [r[0] for r in cur.fetchall()]
        ids = [uuid.uuid4().hex for _ in range(comparisons)]
        with cur.copy("COPY comparisons (id, project_id, reference_id, target_id, mode, status, verdict, counts,"
                      " unmatched, attempts, created_at) FROM STDIN") as cp:
            for n, cid in enumerate(ids):
                cp.write_row((cid, pid, "ref", "tgt", "propagated", "done", "pass", "{}", 0, 1,
                              now - timedelta(minutes=comparisons - n)))
        verdicts = np.array(["pass", "warn", "fail"])
        with cur.copy("COPY op_results (comparison_id, series_id, key, output, op, module, kind, index,"
                      " shape_signature, dtype, verdict, reason, inherited, severity, norm_l2, max_abs, max_rel,"
                      " cosine, snr_db, budget, created_at) FROM STDIN") as cp:
            for n, cid in enumerate(ids):
                sev = rng.random(OPS_PER_COMPARISON)
                v = verdicts[np.minimum((sev * 3.2).astype(int), 2)]
                at = now - timedelta(minutes=comparisons - n)
                for i in range(OPS_PER_COMPARISON):
                    cp.write_row((cid, series[i], f"model.layers.{i // 10}.mlp/aten.mm#{i % 10}", 0, "aten.mm",
                                  f"model.layers.{i // 10}.mlp", "aten", i, "64x128", "float32", str(v[i]), "",
                                  False, float(sev[i]), float(sev[i]) * 1e-2, 0.1, 0.1, 0.999, 40.0,
                                  '{"norm_l2": 0.01}', at))
        with cur.copy("COPY regressions (project_id, series_id, key, op, shape_signature, status, first_comparison_id,"
                      " last_comparison_id, reason, created_at, updated_at) FROM STDIN") as cp:
            for i in range(0, OPS_PER_COMPARISON, 10):
                cp.write_row((pid, series[i], f"model.layers.{i // 10}.mlp/aten.mm#0", "aten.mm", "64x128",
                              "active", ids[0], ids[-1], "", now, now))
        conn.commit()
        cur.execute("ANALYZE")


def time_queries(url: str) -> dict[str, float]:
    """Median milliseconds of each query, the way the routes call them."""
    from api.store import queries
    from api.store.db import Database
    from api.store.models import Comparison, Project
    from api.settings import Settings

    db = Database(Settings(database_url=url))
    with db.session() as s:
        project = s.query(Project).one()
        latest = s.query(Comparison).order_by(Comparison.created_at.desc()).first()
    assert latest is not None
    cases = {
        "ops(worst 50)": lambda: queries.op_results(db, latest.id, limit=50),
        "ops(verdict=fail,module glob)": lambda: queries.op_results(db, latest.id, verdict="fail",
                                                                     module="model.layers.1*", limit=50),
        "regressions": lambda: queries.regressions(db, project, "active", None, None, 50, 0),
        "regressions(op,shape)": lambda: queries.regressions(db, project, "active", "aten.mm", "64x128", 50, 0),
        "drift(worst 8 series, 10 pts)": lambda: queries.drift(db, project, "norm_l2", None, None, 8, 10),
        "drift(one key, 10 pts)": lambda: queries.drift(db, project, "norm_l2", "model.layers.3.mlp/aten.mm#4", None, 8, 10),
    }
    out = {}
    for name, fn in cases.items():
        fn()
        samples = []
        for _ in range(15):
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1000)
        out[name] = statistics.median(samples)
    db.dispose()
    return out


def explain(url: str) -> None:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        cid = conn.execute("SELECT id FROM comparisons ORDER BY created_at DESC LIMIT 1").fetchone()[0]  # type: ignore[index]
        sid = conn.execute("SELECT id FROM series LIMIT 1").fetchone()[0]  # type: ignore[index]
        for sql, args in (
            ("SELECT * FROM op_results WHERE comparison_id = %s ORDER BY severity DESC NULLS LAST, index LIMIT 50", (cid,)),
            ("SELECT created_at, norm_l2 FROM op_results WHERE series_id = %s ORDER BY created_at DESC LIMIT 100", (sid,)),
        ):
            plan = conn.execute("EXPLAIN " + sql, args).fetchall()
            print("  EXPLAIN", sql.split(" WHERE")[0][:40], "...:", " | ".join(r[0].strip() for r in plan[:3]))


def with_database(fn):  # type: ignore[no-untyped-def]
    import psycopg

    name = f"opband_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + "/" + name
    try:
        return fn(url)
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-ingest", action="store_true")
    parser.add_argument("--skip-queries", action="store_true")
    parser.add_argument("--sizes-mb", default="100,1000")
    args = parser.parse_args()
    if not args.skip_ingest:
        with tempfile.TemporaryDirectory(prefix="opband-bench-") as d:
            rows = []
            for mb in (int(x) for x in args.sizes_mb.split(",")):
                up, raw, rss = ingest(mb * 1_000_000, Path(d))
                rows.append((mb, up, raw, rss))
                print(f"ingest {mb:5d} MB: upload {up:6.2f} s, raw write {raw:6.2f} s, ratio {up / raw:5.2f}, "
                      f"server peak RSS {rss:6.1f} MB")
            if len(rows) > 1:
                print(f"peak RSS ratio {rows[-1][0]} MB / {rows[0][0]} MB bundle: {rows[-1][3] / rows[0][3]:.2f}")
    if not args.skip_queries:
        def run(n: int):  # type: ignore[no-untyped-def]
            def inner(url: str):  # type: ignore[no-untyped-def]
                started = time.perf_counter()
                load(url, n)
                print(f"loaded {n:,} op results in {time.perf_counter() - started:.1f} s")
                t = time_queries(url)
                if n >= 1_000_000:
                    explain(url)
                return t

            return with_database(inner)

        small, large = run(10_000), run(1_000_000)
        for name in small:
            print(f"query {name:32s} 1e4: {small[name]:7.2f} ms  1e6: {large[name]:7.2f} ms  "
                  f"ratio {large[name] / small[name]:5.2f}")


if __name__ == "__main__":
    main()
