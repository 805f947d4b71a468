"""Throughput of the full metric suite relative to one ``np.abs(a - b).max()`` pass.

Run: ``.venv/bin/python benchmarks/compare.py [--numel 25000000] [--repeat 7]``.

Each measurement is a ratio taken in the same run, so it is comparable across machines:

- in memory: ``compare_arrays(a, b)`` (the fused kernel of :mod:`accuracy.fused`: every metric,
  the exact histogram and the quantiles in one read) on two float32 arrays vs
  ``np.abs(a - b).max()`` on them (which makes two temporaries);
- bf16 / fp16: the same suite on the same values rounded to bfloat16 (raw words, as bundles store
  them) and float16, vs the same float32 baseline (half the bytes to read);
- memory-mapped: the arrays written into a bundle with ``BundleWriter`` (in a temporary
  directory), opened with ``Bundle.open`` and compared through ``Bundle.stored`` (as
  ``accuracy.compare`` reads them), vs ``np.abs(a - b).max()`` over the bundle's mapped arrays;
- bundle write: ``BundleWriter`` (``add_array`` x 2 + ``close``) vs a raw sequential write of the
  same bytes to a plain file.

The timings are interleaved (one of each per round) and each ratio is the median over
``--repeat`` rounds (at least 5), so a noisy neighbour on a shared machine hits both sides alike.
GB/s counts the bytes of both inputs. Goals (issue 14): suite <= 1.0x in memory, bf16/fp16 at
least as fast as float32; bundle write close to 1x.
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

from accuracy import fused, metrics  # noqa: E402
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

    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    abf, bbf = _bf16_words(a), _bf16_words(b)
    compare_arrays(abf, bbf, "bfloat16", reference_dtype="BF16", stored_dtype="BF16")  # compile outside the timing
    compare_arrays(a16, b16, "float16")

    with tempfile.TemporaryDirectory(prefix="opband-bench-") as tmp:
        bundle_path = Path(tmp) / "ab.bundle"
        write_bundle(bundle_path, a, b)
        bundle = Bundle.open(bundle_path)
        expected = compare_arrays(a, b, "float32").as_dict()
        got = compare_arrays(bundle.stored("a")[0], bundle.stored("b")[0], "float32").as_dict()
        if got != expected:
            raise SystemExit("memory-mapped comparison differs from the in-memory one")

        def mm_baseline() -> object:
            fresh = Bundle.open(bundle_path)  # a fresh mapping, as mm_suite makes
            x, y = fresh.values("a"), fresh.values("b")
            return np.abs(x - y).max()

        def mm_suite() -> object:
            fresh = Bundle.open(bundle_path)
            return compare_arrays(fresh.stored("a")[0], fresh.stored("b")[0], "float32")

        def bundle_write() -> None:
            write_bundle(Path(tmp) / "w.bundle", a, b)
            os.unlink(Path(tmp) / "w.bundle")

        def raw_write() -> None:
            write_raw(Path(tmp) / "w.raw", a, b)
            os.unlink(Path(tmp) / "w.raw")

        cases: dict[str, Callable[[], object]] = {
            "baseline": lambda: np.abs(a - b).max(),
            "suite": lambda: compare_arrays(a, b, "float32"),
            "bf16": lambda: compare_arrays(abf, bbf, "bfloat16", reference_dtype="BF16", stored_dtype="BF16"),
            "fp16": lambda: compare_arrays(a16, b16, "float16"),
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

    def row(label: str, key: str, nbytes: float) -> None:
        print(f"{label:36s}: {med[key] * 1e3:7.1f} ms  ({nbytes / med[key]:5.2f} GB/s read)")

    print(f"numel {args.numel:,} x 2 ({gb:.2f} GB of float32 per pass), {fused.default_threads()} threads, "
          f"median of {repeat} interleaved rounds")
    row("in memory   np.abs(a - b).max()", "baseline", gb)
    row("in memory   compare_arrays float32", "suite", gb)
    row("in memory   compare_arrays bf16", "bf16", gb / 2)
    row("in memory   compare_arrays fp16", "fp16", gb / 2)
    row("memory-map  np.abs(a - b).max()", "mm_baseline", gb)
    row("memory-map  compare_arrays float32", "mm_suite", gb)
    out = {"ratio": ratio("suite", "baseline"), "bf16_ratio": ratio("bf16", "baseline"),
           "fp16_ratio": ratio("fp16", "baseline"), "mm_ratio": ratio("mm_suite", "mm_baseline")}
    print(f"ratio in memory float32 : {out['ratio']:.2f}x  (goal <= 1.0x)")
    print(f"ratio in memory bf16    : {out['bf16_ratio']:.2f}x  (same elements; goal <= the float32 ratio)")
    print(f"ratio in memory fp16    : {out['fp16_ratio']:.2f}x  (same elements; goal <= the float32 ratio)")
    print(f"ratio memory-mapped     : {out['mm_ratio']:.2f}x")
    if not args.no_write:
        out["write_ratio"] = ratio("bundle_write", "raw_write")
        print(f"raw write          : {med['raw_write'] * 1e3:7.1f} ms  ({gb / med['raw_write']:5.2f} GB/s)")
        print(f"BundleWriter write : {med['bundle_write'] * 1e3:7.1f} ms  ({gb / med['bundle_write']:5.2f} GB/s)")
        print(f"ratio write         : {out['write_ratio']:.2f}x  (BundleWriter / raw write)")
    return out


def _bf16_words(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 words (round to nearest even), as a bundle stores them."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


if __name__ == "__main__":
    main()
