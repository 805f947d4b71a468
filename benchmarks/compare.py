"""Throughput of the full metric suite relative to one ``np.abs(a - b).max()`` pass.

Run: ``.venv/bin/python benchmarks/compare.py [--numel 25000000] [--repeat 7]``.

Three measurements, each a ratio taken in the same run so it is comparable across machines:

- in memory: ``compare_arrays(a, b)`` on two float32 arrays vs ``np.abs(a - b).max()`` on them;
- memory-mapped: the same arrays written into a bundle with ``BundleWriter`` (in a temporary
  directory), opened with ``Bundle.open`` and compared through ``Bundle.iter_chunks``, vs
  ``np.abs(a - b).max()`` over the bundle's memory-mapped arrays (freshly mapped each run, like the
  chunk iterators);
- bundle write: ``BundleWriter`` (``add_array`` x 2 + ``close``) vs a raw sequential write of the
  same bytes to a plain file.

The timings are interleaved (one of each per round) and each ratio is the median over
``--repeat`` rounds (at least 5), so a noisy neighbour on a shared machine hits both sides alike.
Goals: suite ratios <= 2x; bundle write close to 1x.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accuracy import metrics  # noqa: E402
from accuracy.bundle import Bundle, BundleWriter  # noqa: E402
from accuracy.manifest import Manifest  # noqa: E402
from accuracy.metrics import compare_arrays  # noqa: E402


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_bundle(path: Path, a: np.ndarray, b: np.ndarray) -> None:
    w = BundleWriter(path)
    w.add_array("a", a)
    w.add_array("b", b)
    w.close(Manifest())


def write_raw(path: Path, a: np.ndarray, b: np.ndarray) -> None:
    with open(path, "wb") as f:
        f.write(a.data)
        f.write(b.data)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds (>= 5)")
    parser.add_argument("--chunk", type=int, default=metrics.CHUNK, help="elements per chunk")
    parser.add_argument("--no-write", action="store_true", help="skip the bundle write measurement")
    args = parser.parse_args(argv)
    repeat = max(args.repeat, 5)
    metrics.CHUNK = args.chunk
    rng = np.random.default_rng(0)
    a = rng.standard_normal(args.numel, dtype=np.float32)
    b = (a + rng.standard_normal(args.numel, dtype=np.float32) * np.float32(1e-3) * a).astype(np.float32)
    gb = 2 * a.nbytes / 1e9

    with tempfile.TemporaryDirectory(prefix="opband-bench-") as tmp:
        bundle_path = Path(tmp) / "ab.bundle"
        write_bundle(bundle_path, a, b)
        bundle = Bundle.open(bundle_path)
        expected = compare_arrays(a, b, "float32").as_dict()
        got = compare_arrays(bundle.iter_chunks("a"), bundle.iter_chunks("b"), "float32").as_dict()
        if got != expected:
            raise SystemExit("memory-mapped comparison differs from the in-memory one")

        def mm_baseline() -> object:
            x, y = bundle.values("a"), bundle.values("b")  # fresh mappings, as iter_chunks makes
            return np.abs(x - y).max()

        def mm_suite() -> object:
            return compare_arrays(bundle.iter_chunks("a"), bundle.iter_chunks("b"), "float32")

        def bundle_write() -> None:
            write_bundle(Path(tmp) / "w.bundle", a, b)
            os.unlink(Path(tmp) / "w.bundle")

        def raw_write() -> None:
            write_raw(Path(tmp) / "w.raw", a, b)
            os.unlink(Path(tmp) / "w.raw")

        cases: dict[str, Callable[[], object]] = {
            "baseline": lambda: np.abs(a - b).max(),
            "suite": lambda: compare_arrays(a, b, "float32"),
            "mm_baseline": mm_baseline,
            "mm_suite": mm_suite,
        }
        if not args.no_write:
            cases |= {"raw_write": raw_write, "bundle_write": bundle_write}
        for fn in cases.values():  # warm-up: page cache, allocator, buffers
            fn()
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(repeat):
            for name, fn in cases.items():
                times[name].append(timed(fn))

    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(num: str, den: str) -> float:
        return statistics.median(x / y for x, y in zip(times[num], times[den], strict=True))

    print(f"numel {args.numel:,} float32 x 2 ({gb:.2f} GB read per pass), chunk {metrics.CHUNK:,}, "
          f"median of {repeat} interleaved rounds")
    print(f"in memory   np.abs(a - b).max(): {med['baseline'] * 1e3:7.1f} ms  ({gb / med['baseline']:5.2f} GB/s)")
    print(f"in memory   compare_arrays     : {med['suite'] * 1e3:7.1f} ms  ({gb / med['suite']:5.2f} GB/s)")
    print(f"memory-map  np.abs(a - b).max(): {med['mm_baseline'] * 1e3:7.1f} ms  ({gb / med['mm_baseline']:5.2f} GB/s)")
    print(f"memory-map  compare_arrays     : {med['mm_suite'] * 1e3:7.1f} ms  ({gb / med['mm_suite']:5.2f} GB/s)")
    out = {"ratio": ratio("suite", "baseline"), "mm_ratio": ratio("mm_suite", "mm_baseline")}
    print(f"ratio in memory     : {out['ratio']:.2f}x  (goal <= 2x)")
    print(f"ratio memory-mapped : {out['mm_ratio']:.2f}x  (goal <= 2x)")
    if not args.no_write:
        out["write_ratio"] = ratio("bundle_write", "raw_write")
        print(f"raw write          : {med['raw_write'] * 1e3:7.1f} ms  ({gb / med['raw_write']:5.2f} GB/s)")
        print(f"BundleWriter write : {med['bundle_write'] * 1e3:7.1f} ms  ({gb / med['bundle_write']:5.2f} GB/s)")
        print(f"ratio write         : {out['write_ratio']:.2f}x  (BundleWriter / raw write)")
    return out


if __name__ == "__main__":
    main()
