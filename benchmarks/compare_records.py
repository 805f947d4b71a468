"""Compare and ingest time and memory against the number of records (not a test).

Run: ``.venv/bin/python benchmarks/compare_records.py [--records 10000,100000,1000000] [--numel 64]
[--under /path/to/other/opband]``.

For each record count N a child process writes a float32 reference bundle and a bfloat16 target
bundle of N small records (``--numel`` elements each, about what a small op's output holds) with the
streaming writer (``BundleWriter.add_record``; an opband without it gets the records in the manifest,
as format 1.x did). Then, each in a fresh child process:

- **compare**: ``accuracy.compare`` of the pair; records/s, the time per record, the part of it
  beyond the metric kernel's own pass over the same bytes (one ``compare_arrays`` over all of them as
  one array, measured in the same child), and the child's peak RSS (``ru_maxrss``). The child loads
  the metric kernels (numba's cache, or a compile) before the timing, as a long-lived worker has them.
- **ingest**: ``api.store.ingest.store_bundle`` of the target into SQLite and a local blob folder
  (validation and the op_records inserts in the one child: ``isolate=False``); records/s and peak RSS.

With ``--under ROOT`` every step also runs with the opband at ROOT (the baseline of a before/after
run), interleaved with this one, and the table prints the ratio. Records/s that stay flat from 10^4
to 10^6 mean linear time; CPU time (``process_time``) is printed, wall time is noisy on a shared box.
Each child runs ``--rounds`` times (default 3, the two opbands interleaved): the median run is
printed, its spread (slowest - fastest) next to it, and the largest peak RSS of the rounds.
Goals (issue 14): <= 1 GB peak at 10^6; linear time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import shutil
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)

_WRITE = """
import json, sys, time
import numpy as np
from accuracy.bundle import BundleWriter
from accuracy.manifest import Manifest, Record, Stats

def bf16_words(x):
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)

folder, n, numel = {folder!r}, {n}, {numel}
streaming = hasattr(BundleWriter, "add_record")
t = time.process_time()
rng = np.random.default_rng(0)
ref_w, tgt_w = BundleWriter(folder + "/ref.bundle"), BundleWriter(folder + "/tgt.bundle")
ref_recs, tgt_recs = [], []
for start in range(0, n, 4096):
    count = min(4096, n - start)
    values = rng.standard_normal((count, numel), dtype=np.float32)
    words = bf16_words(values)
    lo, hi, amax = values.min(axis=1), values.max(axis=1), np.abs(values).max(axis=1)
    for j in range(count):
        i = start + j
        module = f"model.layers.{{i // 64}}.block{{i % 64 // 8}}"
        name = f"t{{i}}"
        ref_w.add_array(name, values[j])
        tgt_w.add_array(name, words[j], dtype="BF16")
        common = dict(key=f"{{module}}/aten.mul#{{i % 8}}", module=module, op="aten.mul", ordinal=i % 8, index=i,
                      input_shapes=[[numel], [numel]], input_dtypes=["float32", "float32"], shape=[numel], tensor=name)
        stats = Stats.model_construct(numel=numel, min=float(lo[j]), max=float(hi[j]), absmax=float(amax[j]))
        r = Record.model_construct(**common, dtype="float32", stats=stats)
        g = Record.model_construct(**common, dtype="bfloat16", stats=None)
        if streaming:
            ref_w.add_record(r); tgt_w.add_record(g)
        else:
            ref_recs.append(r); tgt_recs.append(g)
run = {{"device": "cpu", "variant": "fp32", "level": "aten", "mode": "full"}}
ref_w.close(Manifest(run=run, records=ref_recs))
tgt_w.close(Manifest(run={{**run, "variant": "bf16"}}, records=tgt_recs))
print(json.dumps({{"cpu": time.process_time() - t, "streaming": streaming}}))
"""

_COMPARE = """
import json, resource, time
import numpy as np
from accuracy.compare import compare
from accuracy.metrics import compare_arrays
from accuracy.bundle import Bundle
try:  # load (or compile) the metric kernels outside the timing, as a long-lived worker has them
    from accuracy import fused
    if hasattr(fused, "warm_up"):
        fused.warm_up(errors=True)
    compare_arrays(np.zeros(4, np.float32), np.zeros(4, np.uint16), "bfloat16", stored_dtype="BF16")
except (ImportError, TypeError):
    compare_arrays(np.zeros(4, np.float32), np.zeros(4, np.float32), "bfloat16")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter(); c = time.process_time()
rep = compare({ref!r}, {tgt!r})
wall, cpu = time.perf_counter() - t, time.process_time() - c
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
total = len(rep.ops) + getattr(rep, "passes_not_listed", 0)
r, g = Bundle.open({ref!r}), Bundle.open({tgt!r})
a = np.concatenate([r.raw(f"t{{i}}").reshape(-1) for i in range({n})])
b = np.concatenate([g.raw(f"t{{i}}").reshape(-1) for i in range({n})])
try:
    compare_arrays(a[:4], b[:4], "bfloat16", stored_dtype="BF16")
    args, kw = (a, b, "bfloat16"), {{"stored_dtype": "BF16"}}
except TypeError:  # an opband without stored-form reads
    args, kw = (a, (b.astype(np.uint32) << 16).view(np.float32), "bfloat16"), {{}}
k = time.process_time(); compare_arrays(*args, **kw); kernel = time.process_time() - k
print(json.dumps({{"wall": wall, "cpu": cpu, "kernel": kernel, "ops": total, "verdict": rep.verdict,
                  "rss_before": before * 1024, "rss_peak": peak * 1024}}))
"""

_INGEST = """
import json, os, resource, shutil, time, uuid
from pathlib import Path
from api.settings import Settings
from api.store.db import Database, upgrade
from api.store.blobs import LocalStore
from api.store.ingest import IngestLimits, SpooledUpload, store_bundle
from api.store.models import Project
data = Path({folder!r}) / "svc"
settings = Settings(data_dir=data)
data.mkdir(exist_ok=True)
upgrade(settings.effective_database_url)
db, store = Database(settings), LocalStore(data / "blobs")
with db.session() as s:
    project = Project(name="bench"); s.add(project)
upload = data / "upload.partial"
shutil.copyfile({tgt!r}, upload)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter(); c = time.process_time()
row, created = store_bundle(db, store, project, SpooledUpload(upload, uuid.uuid4().hex, upload.stat().st_size),
                            limits=IngestLimits(max_manifest_bytes=1 << 32, max_records=10**8), isolate=False)
wall, cpu = time.perf_counter() - t, time.process_time() - c
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"wall": wall, "cpu": cpu, "records": row.records, "rss_before": before * 1024, "rss_peak": peak * 1024}}))
"""


def _child(code: str, root: str) -> dict[str, float] | str:
    """Run ``code`` under the opband at ``root``; its JSON line, or the last line of its error."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=root,
                         env={**os.environ, "PYTHONPATH": root})
    if out.returncode != 0:
        return (out.stderr.strip().splitlines() or ["failed"])[-1][:160]
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(n: int, numel: int, roots: list[str], where: str | None,
            rounds: int) -> list[dict[str, dict[str, float] | str]]:
    """Write a pair of N records with the opband at each of ``roots``, then compare each pair and ingest
    its target ``rounds`` times, the roots interleaved within each round; per root and step, the
    round of median CPU time (peak RSS: the largest of the rounds)."""
    if where is not None:
        os.makedirs(where, exist_ok=True)
    with ExitStack() as stack:
        dirs, results = [], []
        for root in roots:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(dir=where, prefix="opband-records-"))
            t = time.perf_counter()
            wrote = _child(_WRITE.format(folder=tmp, n=n, numel=numel), root)
            if not isinstance(wrote, str):
                wrote["wall"] = time.perf_counter() - t
                wrote["bytes"] = os.path.getsize(f"{tmp}/tgt.bundle")
            dirs.append(tmp)
            results.append({"write": wrote})
        runs: list[dict[str, list[dict[str, float] | str]]] = [{"compare": [], "ingest": []} for _ in roots]
        for _ in range(rounds):
            for i, (root, tmp) in enumerate(zip(roots, dirs, strict=True)):
                if isinstance(results[i]["write"], str):
                    continue
                ref, tgt = f"{tmp}/ref.bundle", f"{tmp}/tgt.bundle"
                runs[i]["compare"].append(_child(_COMPARE.format(ref=ref, tgt=tgt, n=n), root))
                runs[i]["ingest"].append(_child(_INGEST.format(folder=tmp, tgt=tgt), root))
                shutil.rmtree(f"{tmp}/svc", ignore_errors=True)
        for res, by_step in zip(results, runs, strict=True):
            for step, got in by_step.items():
                if got:
                    res[step] = _median_run(got)
        return results


def _median_run(runs: list[dict[str, float] | str]) -> dict[str, float] | str:
    """The run of median CPU time, with the largest peak RSS of all; a failure if any run failed."""
    ok: list[dict[str, float]] = []
    for r in runs:
        if isinstance(r, str):
            return r
        ok.append(r)
    ok.sort(key=lambda r: r["cpu"])
    median = dict(ok[len(ok) // 2])
    median["rss_peak"] = max(r["rss_peak"] for r in ok)
    median["cpu_range"] = ok[-1]["cpu"] - ok[0]["cpu"]
    return median


def _row(label: str, n: int, res: dict[str, float] | str, base: dict[str, float] | str | None) -> str:
    if isinstance(res, str):
        return f"{n:9,d} {label:8s} failed: {res}"
    line = (f"{n:9,d} {label:8s} {res['cpu']:8.2f} {n / res['cpu']:10,.0f} {res['cpu'] / n * 1e6:9.1f} "
            f"{res['rss_peak'] / 1e6:8,.0f} MB {(res['rss_peak'] - res['rss_before']) / 1e6:7,.0f} MB")
    if label == "compare":
        line += f"  {(res['cpu'] - res['kernel']) / n * 1e6:7.1f} us beyond kernel ({res['verdict']}, {res['ops']:,} ops)"
    if "cpu_range" in res:
        line += f"  spread {res['cpu_range']:.2f} s"
    if base is not None:
        line += (f"  | before: {base}" if isinstance(base, str) else
                 f"  | before {n / base['cpu']:,.0f}/s {base['rss_peak'] / 1e6:,.0f} MB: "
                 f"{base['cpu'] / res['cpu']:.1f}x faster, {base['rss_peak'] / res['rss_peak']:.1f}x less memory")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", default="10000,100000,1000000", help="comma-separated record counts")
    ap.add_argument("--numel", type=int, default=64, help="elements per record")
    ap.add_argument("--dir", default=None, help="where to write the bundles (default: a temporary directory)")
    ap.add_argument("--under", default=None, help="also run the opband at this source root (before/after)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="compare and ingest runs per record count (the median's CPU time is printed)")
    args = ap.parse_args()
    print(f"{'records':>9s} {'step':8s} {'cpu s':>8s} {'records/s':>10s} {'us/rec':>9s} {'peak RSS':>11s} "
          f"{'growth':>10s}")
    for n in (int(x) for x in args.records.split(",")):
        roots = [ROOT, args.under] if args.under else [ROOT]
        res, *before = measure(n, args.numel, roots, args.dir, args.rounds)
        base = before[0] if before else None
        w = res["write"]
        if isinstance(w, str):
            print(f"{n:9,d} write    failed: {w}")
            continue
        print(f"{n:9,d} write    {w['cpu']:8.2f} {n / w['cpu']:10,.0f}  (two bundles of {w['bytes'] / 1e6:,.0f} MB, "
              f"wall {w['wall']:.1f} s, {'streamed records' if w['streaming'] else 'records in the manifest'})")
        for step in ("compare", "ingest"):
            print(_row(step, n, res.get(step, "not run"), base.get(step, base["write"]) if base else None), flush=True)

if __name__ == "__main__":
    main()
