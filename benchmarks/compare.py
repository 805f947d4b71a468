"""Throughput of the full metric suite relative to one ``np.abs(a - b).max()`` pass.

Run: ``.venv/bin/python benchmarks/compare.py [--numel 25000000] [--repeat 5]``. Both timings are
taken in the same run on the same two float32 arrays (best of ``--repeat``), so the ratio is
comparable across machines. Goal: ratio <= 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accuracy import metrics  # noqa: E402
from accuracy.metrics import compare_arrays  # noqa: E402


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=metrics.CHUNK, help="elements per chunk")
    args = parser.parse_args(argv)
    metrics.CHUNK = args.chunk
    rng = np.random.default_rng(0)
    a = rng.standard_normal(args.numel, dtype=np.float32)
    b = (a + rng.standard_normal(args.numel, dtype=np.float32) * np.float32(1e-3) * a).astype(np.float32)
    baseline = best_of(lambda: np.abs(a - b).max(), args.repeat)
    suite = best_of(lambda: compare_arrays(a, b, "float32"), args.repeat)
    gb = 2 * a.nbytes / 1e9
    print(f"numel {args.numel:,} float32 x 2 ({gb:.2f} GB read per pass)")
    print(f"np.abs(a - b).max(): {baseline * 1e3:8.1f} ms  ({gb / baseline:5.2f} GB/s)")
    print(f"compare_arrays     : {suite * 1e3:8.1f} ms  ({gb / suite:5.2f} GB/s)")
    print(f"ratio              : {suite / baseline:.2f}x  (goal <= 2x)")
    return suite / baseline


if __name__ == "__main__":
    main()
