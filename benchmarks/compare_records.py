"""Compare time and memory against the number of records (not a test).

Run: ``.venv/bin/python benchmarks/compare_records.py [--records 10000,100000] [--numel 64]``.

For each record count N it writes (once, in a temporary directory) a float32 reference bundle and a
bfloat16 target bundle of N small records (``--numel`` elements each, about what a small op's
output holds), then runs ``accuracy.compare`` on them in a fresh child process and prints
records/s, the time per record, the part of it beyond the metric kernel's own pass over the bytes
(a ``compare_arrays``-equivalent pass over the same bytes as one array, measured in the same child),
and the child's peak RSS (``ru_maxrss``). The child loads the metric kernels (numba's cache, or a
compile) before the timing, as a long-lived worker has them; the time it took is printed. Records/s that stay flat from 10^4 to 10^6 mean linear time.
Goals (issue 14): <= 50 us per record beyond the metrics' memory traffic; <= 1 GB peak at 10^6.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accuracy.bundle import BundleWriter  # noqa: E402
from accuracy.manifest import Manifest, Record, Stats  # noqa: E402


def _bf16_words(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_pair(folder: Path, n: int, numel: int, seed: int = 0) -> tuple[Path, Path]:
    """A float32 reference and a bfloat16 target bundle of ``n`` records of ``numel`` elements."""
    rng = np.random.default_rng(seed)
    block = 4096
    ref_w, tgt_w = BundleWriter(folder / "ref.bundle"), BundleWriter(folder / "tgt.bundle")
    ref_recs: list[Record] = []
    tgt_recs: list[Record] = []
    for start in range(0, n, block):
        count = min(block, n - start)
        values = rng.standard_normal((count, numel), dtype=np.float32)
        words = _bf16_words(values)
        for j in range(count):
            i = start + j
            module = f"model.layers.{i // 64}.block{i % 64 // 8}"
            key = f"{module}/aten.mul#{i % 8}"
            name = f"t{i}"
            r = values[j]
            ref_w.add_array(name, r)
            tgt_w.add_array(name, words[j], dtype="BF16")
            common = {"key": key, "module": module, "op": "aten.mul", "ordinal": i % 8, "index": i,
                      "input_shapes": [[numel], [numel]], "input_dtypes": ["float32", "float32"], "shape": [numel],
                      "tensor": name}
            stats = Stats(numel=numel, min=float(r.min()), max=float(r.max()), absmax=float(np.abs(r).max()))
            ref_recs.append(Record.model_construct(**common, dtype="float32", stats=stats))
            tgt_recs.append(Record.model_construct(**common, dtype="bfloat16", stats=None))
    run = {"device": "cpu", "variant": "fp32", "level": "aten", "mode": "full"}
    ref_w.close(Manifest(run=run, records=ref_recs))
    tgt_w.close(Manifest(run={**run, "variant": "bf16"}, records=tgt_recs))
    return folder / "ref.bundle", folder / "tgt.bundle"


_CHILD = """
import json, resource, sys, time
import numpy as np
from accuracy.compare import compare
from accuracy.metrics import compare_arrays
from accuracy.bundle import Bundle
try:  # load (or compile) the metric kernels outside the timing, as a long-lived worker has them
    from accuracy import fused
    w = time.process_time()
    compare_arrays(np.zeros(4, np.float32), np.zeros(4, np.uint16), "bfloat16", stored_dtype="BF16")
    warm = time.process_time() - w
except ImportError:
    warm = 0.0
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter(); c = time.process_time()
rep = compare({ref!r}, {tgt!r})
wall, cpu = time.perf_counter() - t, time.process_time() - c
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r, g = Bundle.open({ref!r}), Bundle.open({tgt!r})
a = np.concatenate([r.raw(f"t{{i}}").reshape(-1) for i in range({n})])
b = np.concatenate([g.raw(f"t{{i}}").reshape(-1) for i in range({n})])
try:
    compare_arrays(a, b, "bfloat16", stored_dtype="BF16")
    args = (a, b, "bfloat16")
    kw = {{"stored_dtype": "BF16"}}
except TypeError:  # an opband without stored-form reads (the baseline of a before/after run)
    args, kw = (a, (b.astype(np.uint32) << 16).view(np.float32), "bfloat16"), {{}}
    compare_arrays(*args)
k = time.process_time(); compare_arrays(*args, **kw); kernel = time.process_time() - k
print(json.dumps({{"wall": wall, "cpu": cpu, "warm": warm, "kernel": kernel, "ops": len(rep.ops), "verdict": rep.verdict,
                  "rss_before": before * 1024, "rss_peak": peak * 1024}}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", default="10000,100000", help="comma-separated record counts (e.g. 10000,100000,1000000)")
    ap.add_argument("--numel", type=int, default=64, help="elements per record")
    ap.add_argument("--dir", default=None, help="where to write the bundles (default: a temporary directory)")
    ap.add_argument("--under", default=None, help="compare with the opband at this source root (a before/after run)")
    args = ap.parse_args()
    root = str(Path(__file__).resolve().parent.parent)
    print(f"{'records':>9s} {'write s':>8s} {'compare s':>10s} {'records/s':>10s} {'us/record':>10s} "
          f"{'beyond kernel':>14s} {'peak RSS':>9s}")
    for n in (int(x) for x in args.records.split(",")):
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="opband-records-") as tmp:
            t = time.perf_counter()
            ref, tgt = write_pair(Path(tmp), n, args.numel)
            written = time.perf_counter() - t
            code = _CHILD.format(root=root, ref=str(ref), tgt=str(tgt), n=n)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                                 env={**os.environ, "PYTHONPATH": args.under or root})
            if out.returncode != 0:
                raise SystemExit(f"compare of {n:,} records failed:\n{out.stderr[-3000:]}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
        per = res["cpu"] / n
        beyond = (res["cpu"] - res["kernel"]) / n
        print(f"{n:9,d} {written:8.1f} {res['cpu']:10.2f} {n / res['cpu']:10,.0f} {per * 1e6:10.1f} "
              f"{beyond * 1e6:11.1f} us {res['rss_peak'] / 1e6:7,.0f} MB   ({res['ops']:,} ops, {res['verdict']}, "
              f"wall {res['wall']:.2f} s; kernels loaded beforehand in {res['warm']:.2f} s)")


if __name__ == "__main__":
    main()
